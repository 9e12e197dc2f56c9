//! One AWS call without a service crate: a request signed with AWS's own SigV4 crate
//! (`aws-sigv4`) and sent over the SDK's own HTTP connector (hyper, rustls on ring), with the
//! SDK's region, credential chain and endpoint settings, its timeouts and its three attempts.
//!
//! Used where a generated service crate would cost far more to build than the calls it makes:
//! EC2's two (`DescribeInstances`, `RebootInstances`; [`super::ec2`], the Query protocol) would
//! otherwise pull in `aws-sdk-ec2`, 88 MB of generated source (BENCHMARKS.md, "The build");
//! EventBridge's one (`PutEvents`; [`super::events`]) and CloudWatch Logs' four
//! ([`super::logs`]) are AWS's JSON protocol ([`SignedClient::post_json`]). What this gives up
//! against the SDK: FIPS and dual-stack endpoints (set `AWS_ENDPOINT_URL_EC2` for those) and the
//! SDK's client-side rate limiter; both matter at thousands of calls a second, not at five a
//! minute.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_config::SdkConfig;
use aws_credential_types::Credentials;
use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider};
use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::http::HttpConnector;
use aws_smithy_runtime_api::client::result::ConnectorError;
use aws_smithy_types::body::SdkBody;
use http_body_util::BodyExt;
use tokio::sync::Mutex;

use super::calls::{CallError, error_chain};

/// The most of a response body read (EC2 answers a handful of instances in a few KiB; a
/// FilterLogEvents page is at most 1 MB of messages).
const MAX_BODY: usize = 4 << 20;
/// The SDK's settings ([`super::loader`]): per attempt, per call (all attempts), to connect.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(20);
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_ATTEMPTS: u32 = 3;
/// The window of the wait before the second attempt, doubled before the third, each wait
/// drawn at random from its window (full jitter, [`crate::sys::backoff`]): the SDK's standard
/// retry mode, whose initial backoff is 1 s and whose longest is 20 s.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(20);
/// Credentials are fetched again this long before they expire.
const REFRESH_BEFORE: Duration = Duration::from_secs(300);

/// A service's signing name and endpoint, as the SDK would resolve them.
#[derive(Debug, Clone, Copy)]
pub struct Service {
    /// The SDK's service id, for `AWS_ENDPOINT_URL_<ID>` and the profile's `services` section.
    pub id: &'static str,
    /// SigV4's signing name and the endpoint's first label (`ec2`).
    pub signing_name: &'static str,
}

/// A client for one service: shared by clones (one credentials cache, one connection pool).
#[derive(Clone)]
pub struct SignedClient {
    inner: Arc<Inner>,
}

struct Inner {
    service: Service,
    /// The endpoint, or why there is none (no region): said by every call.
    endpoint: Result<String, String>,
    region: Option<String>,
    credentials: Option<SharedCredentialsProvider>,
    cached: Mutex<Option<Credentials>>,
    connector: aws_smithy_http_client::Connector,
}

impl std::fmt::Debug for SignedClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignedClient")
            .field("service", &self.inner.service.id)
            .field("endpoint", &self.inner.endpoint)
            .finish()
    }
}

/// A successful call: the body and the request id AWS gave it.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: String,
    pub request_id: Option<String>,
    /// The JSON protocols' `x-amzn-ErrorType` header, which names a refusal's code ahead of
    /// the body.
    pub error_type: Option<String>,
}

impl SignedClient {
    pub fn new(sdk: &SdkConfig, service: Service) -> Self {
        let region = sdk.region().map(|r| r.as_ref().to_string());
        let endpoint = endpoint(sdk, service, region.as_deref());
        let connector = super::connector(
            aws_smithy_runtime_api::client::http::HttpConnectorSettings::builder()
                .connect_timeout(CONNECT_TIMEOUT)
                .build(),
        );
        SignedClient {
            inner: Arc::new(Inner {
                service,
                endpoint,
                region,
                credentials: sdk.credentials_provider(),
                cached: Mutex::new(None),
                connector,
            }),
        }
    }

    /// POSTs a form (`application/x-www-form-urlencoded`: the Query protocols) to the
    /// endpoint's root; up to three attempts while the failure is retryable. An answer other
    /// than 2xx is handed to `service_error`, which reads the service's code and message.
    pub async fn post_form(
        &self,
        op: &'static str,
        form: &str,
        service_error: fn(&str) -> ServiceError,
    ) -> Result<Reply, CallError> {
        let body = Body {
            content_type: "application/x-www-form-urlencoded; charset=utf-8",
            target: None,
            text: form,
        };
        self.post(op, &body, service_error).await
    }

    /// One call of AWS's JSON protocol (1.1): `body` POSTed to the endpoint's root with
    /// `X-Amz-Target: <target>`; the same attempts as [`post_form`](Self::post_form). A
    /// refusal's code and message are read from the answer ([`json_error`]); a 2xx answer
    /// that is not JSON is a terminal error (an empty one is `{}`).
    pub async fn post_json(
        &self,
        op: &'static str,
        target: &str,
        body: &serde_json::Value,
    ) -> Result<(serde_json::Value, Option<String>), CallError> {
        let text = body.to_string();
        let body = Body {
            content_type: "application/x-amz-json-1.1",
            target: Some(target),
            text: &text,
        };
        let reply = self.post(op, &body, json_error).await?;
        // An operation without output members answers 2xx with an empty body (CloudWatch
        // Logs' CreateLogGroup and CreateLogStream; moto likewise): that is `{}`, as the SDKs
        // read it, not an unreadable answer.
        if reply.body.trim().is_empty() {
            return Ok((serde_json::json!({}), reply.request_id));
        }
        let value = serde_json::from_str(&reply.body).map_err(|e| CallError {
            op,
            code: None,
            message: format!("unreadable response (HTTP {}): {e}", reply.status),
            retryable: false,
            request_id: reply.request_id.clone(),
        })?;
        Ok((value, reply.request_id))
    }

    async fn post(
        &self,
        op: &'static str,
        body: &Body<'_>,
        service_error: fn(&str) -> ServiceError,
    ) -> Result<Reply, CallError> {
        let call = async {
            let mut attempt = 1;
            loop {
                let r = match tokio::time::timeout(ATTEMPT_TIMEOUT, self.attempt(op, body)).await {
                    Ok(r) => r,
                    Err(_) => Err(CallError::transient(op, "timed out")),
                };
                let r = r.and_then(|reply| accept(op, reply, service_error));
                match r {
                    Err(e) if e.retryable && attempt < MAX_ATTEMPTS => {
                        tokio::time::sleep(crate::sys::backoff::full_jitter(
                            FIRST_BACKOFF,
                            attempt - 1,
                            MAX_BACKOFF,
                        ))
                        .await;
                        attempt += 1;
                    }
                    other => return other,
                }
            }
        };
        tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .unwrap_or_else(|_| Err(CallError::transient(op, "timed out")))
    }

    async fn attempt(&self, op: &'static str, body: &Body<'_>) -> Result<Reply, CallError> {
        let inner = &self.inner;
        let endpoint = inner
            .endpoint
            .as_deref()
            .map_err(|why| CallError::terminal(op, why.clone()))?;
        let Some(region) = inner.region.as_deref() else {
            return Err(CallError::terminal(op, "no AWS region is set"));
        };
        let creds = self.credentials(op).await?;
        let mut req = http::Request::builder()
            .method("POST")
            .uri(endpoint)
            .header("content-type", body.content_type)
            .header(
                "user-agent",
                concat!("gpu-medic/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(target) = body.target {
            req = req.header("x-amz-target", target);
        }
        let mut req = req
            .body(SdkBody::from(body.text.to_string()))
            .map_err(|e| CallError::terminal(op, format!("bad endpoint {endpoint}: {e}")))?;
        sign_request(
            &mut req,
            &creds,
            region,
            inner.service.signing_name,
            body.text,
        )
        .map_err(|e| CallError::terminal(op, format!("cannot sign the request: {e}")))?;
        let req = aws_smithy_runtime_api::http::Request::try_from(req)
            .map_err(|e| CallError::terminal(op, format!("bad request: {e}")))?;
        let resp = inner
            .connector
            .call(req)
            .await
            .map_err(|e| dispatch_error(op, &e))?;
        let status = resp.status().as_u16();
        let header_id = resp
            .headers()
            .get("x-amzn-requestid")
            .or_else(|| resp.headers().get("x-amz-request-id"))
            .map(str::to_string);
        let error_type = resp.headers().get("x-amzn-errortype").map(str::to_string);
        let body = http_body_util::Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| {
                CallError::transient(op, format!("unreadable response (HTTP {status}): {e}"))
            })?
            .to_bytes();
        Ok(Reply {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
            request_id: header_id,
            error_type,
        })
    }

    /// The SDK's credential chain, asked again only near expiry (the SDK caches the same way).
    async fn credentials(&self, op: &'static str) -> Result<Credentials, CallError> {
        let mut cached = self.inner.cached.lock().await;
        if let Some(c) = cached.as_ref()
            && c.expiry()
                .is_none_or(|e| e > SystemTime::now() + REFRESH_BEFORE)
        {
            return Ok(c.clone());
        }
        let Some(provider) = &self.inner.credentials else {
            return Err(CallError::terminal(op, "no AWS credentials provider"));
        };
        let c = provider.provide_credentials().await.map_err(|e| {
            // The chain fails on a missing source (terminal) and on an unreachable one, e.g.
            // IMDS while the network comes up (worth another try).
            let retryable = !matches!(
                e,
                aws_credential_types::provider::error::CredentialsError::CredentialsNotLoaded(_)
            );
            CallError {
                op,
                code: None,
                message: format!("no AWS credentials: {}", error_chain(&e)),
                retryable,
                request_id: None,
            }
        })?;
        *cached = Some(c.clone());
        Ok(c)
    }
}

/// What one call sends: its content type, the JSON protocol's target, the body.
struct Body<'a> {
    content_type: &'static str,
    target: Option<&'a str>,
    text: &'a str,
}

fn sign_request(
    req: &mut http::Request<SdkBody>,
    creds: &Credentials,
    region: &str,
    signing_name: &str,
    body: &str,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let identity = creds.clone().into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(signing_name)
        .time(SystemTime::now())
        .settings(SigningSettings::default())
        .build()?
        .into();
    let uri = req.uri().to_string();
    let headers = req
        .headers()
        .iter()
        .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)));
    let signable = SignableRequest::new(
        req.method().as_str(),
        &uri,
        headers,
        SignableBody::Bytes(body.as_bytes()),
    )?;
    let (instructions, _) = sign(signable, &params)?.into_parts();
    instructions.apply_to_request_http1x(req);
    Ok(())
}

/// What a service said when it refused: its code, message and request id from the body.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ServiceError {
    pub code: Option<String>,
    pub message: Option<String>,
    pub request_id: Option<String>,
}

/// A JSON protocol's refusal, read as the SDK reads it: the code from `__type` (or `code`),
/// without the namespace before `#` or the URL after `:`
/// (`com.amazonaws.logs#ResourceNotFoundException` is `ResourceNotFoundException`); the
/// message from `message` (or `Message`). A body that is not JSON gives neither.
pub fn json_error(body: &str) -> ServiceError {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
        return ServiceError::default();
    };
    let text = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
    ServiceError {
        code: text("__type")
            .or_else(|| text("code"))
            .and_then(|c| error_code(&c)),
        message: text("message").or_else(|| text("Message")),
        request_id: None,
    }
}

/// A wire error code as a bare name: what comes before a `:` or `,` (a URL, more codes), and
/// after a `#` (the namespace). `None` when nothing is left.
fn error_code(raw: &str) -> Option<String> {
    let c = raw.split([':', ',']).next().unwrap_or(raw);
    let c = c.rsplit('#').next().unwrap_or(c).trim();
    (!c.is_empty()).then(|| c.to_string())
}

/// A 2xx answer is the reply; any other is classified as the SDK classifies a service error
/// ([`super::calls::CallError::from_sdk`]): throttling codes, 5xx and 429 are retryable.
fn accept(
    op: &'static str,
    reply: Reply,
    service_error: fn(&str) -> ServiceError,
) -> Result<Reply, CallError> {
    if (200..300).contains(&reply.status) {
        return Ok(reply);
    }
    let mut e = service_error(&reply.body);
    // The header names the code first, as the SDKs read it.
    if let Some(code) = reply.error_type.as_deref().and_then(error_code) {
        e.code = Some(code);
    }
    let status = reply.status;
    let message = match (&e.code, &e.message) {
        (Some(c), Some(m)) => format!("{c}: {m}"),
        (Some(c), None) => c.clone(),
        (None, Some(m)) => m.clone(),
        (None, None) => format!("HTTP {status}"),
    };
    let retryable = e.code.as_deref().is_some_and(super::calls::retryable_code)
        || status >= 500
        || status == 429;
    Err(CallError {
        op,
        code: e.code,
        message,
        retryable,
        request_id: e.request_id.or(reply.request_id),
    })
}

fn dispatch_error(op: &'static str, e: &ConnectorError) -> CallError {
    if e.is_timeout() {
        return CallError::transient(op, "timed out connecting");
    }
    let message = format!("dispatch failure: {}", error_chain(e));
    // A connector that is misconfigured (bad endpoint) will not heal by itself.
    if e.is_user() {
        CallError::terminal(op, message)
    } else {
        CallError::transient(op, message)
    }
}

/// The endpoint the SDK would call: an endpoint set in `[aws] endpoint_url`, else
/// `AWS_ENDPOINT_URL_<SERVICE>` or the profile's service setting, else `AWS_ENDPOINT_URL` or
/// the profile's `endpoint_url`, else the region's public endpoint.
fn endpoint(sdk: &SdkConfig, service: Service, region: Option<&str>) -> Result<String, String> {
    let configured = if sdk.get_origin("endpoint_url").is_client_config() {
        sdk.endpoint_url().map(str::to_string)
    } else {
        sdk.service_config()
            .and_then(|conf| {
                let key = aws_types::service_config::ServiceConfigKey::builder()
                    .service_id(service.id)
                    .env("AWS_ENDPOINT_URL")
                    .profile("endpoint_url")
                    .build()
                    .ok()?;
                conf.load_config(key)
            })
            .or_else(|| sdk.endpoint_url().map(str::to_string))
    };
    if let Some(url) = configured {
        return Ok(url);
    }
    let Some(region) = region else {
        return Err("no AWS region is set (AWS_REGION, the profile or [aws] region)".to_string());
    };
    Ok(public_endpoint(service.signing_name, region))
}

/// `https://<service>.<region>.<partition's DNS suffix>`: the standard endpoint of every
/// partition gpu-medic's instances run in (commercial and GovCloud: `amazonaws.com`; China:
/// `amazonaws.com.cn`).
pub fn public_endpoint(name: &str, region: &str) -> String {
    let suffix = if region.starts_with("cn-") {
        "amazonaws.com.cn"
    } else {
        "amazonaws.com"
    };
    format!("https://{name}.{region}.{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_endpoints_follow_the_partition() {
        assert_eq!(
            public_endpoint("ec2", "us-east-1"),
            "https://ec2.us-east-1.amazonaws.com"
        );
        assert_eq!(
            public_endpoint("ec2", "cn-north-1"),
            "https://ec2.cn-north-1.amazonaws.com.cn"
        );
        assert_eq!(
            public_endpoint("ec2", "us-gov-west-1"),
            "https://ec2.us-gov-west-1.amazonaws.com"
        );
    }

    fn reply(status: u16, body: &str) -> Reply {
        Reply {
            status,
            body: body.to_string(),
            request_id: Some("hdr-1".to_string()),
            error_type: None,
        }
    }

    fn parsed(_: &str) -> ServiceError {
        ServiceError {
            code: Some("RequestLimitExceeded".to_string()),
            message: Some("slow down".to_string()),
            request_id: Some("body-1".to_string()),
        }
    }

    #[test]
    fn refusals_are_classified_like_the_sdks() {
        assert!(accept("Op", reply(200, "ok"), parsed).is_ok());
        let e = accept("Op", reply(503, ""), parsed).unwrap_err();
        assert!(e.retryable);
        assert_eq!(e.code.as_deref(), Some("RequestLimitExceeded"));
        assert_eq!(e.message, "RequestLimitExceeded: slow down");
        assert_eq!(e.request_id.as_deref(), Some("body-1"));
        let e = accept("Op", reply(403, ""), |_| ServiceError {
            code: Some("UnauthorizedOperation".to_string()),
            ..ServiceError::default()
        })
        .unwrap_err();
        assert!(!e.retryable);
        assert_eq!(e.request_id.as_deref(), Some("hdr-1"));
        let e = accept("Op", reply(400, "garbage"), |_| ServiceError::default()).unwrap_err();
        assert!(!e.retryable);
        assert_eq!(e.message, "HTTP 400");
        assert!(
            accept("Op", reply(429, ""), |_| ServiceError::default())
                .unwrap_err()
                .retryable
        );
    }

    #[test]
    fn json_refusals_name_their_code_and_message() {
        let e = json_error(
            r#"{"__type":"com.amazonaws.logs#ResourceNotFoundException","message":"The specified log group does not exist."}"#,
        );
        assert_eq!(e.code.as_deref(), Some("ResourceNotFoundException"));
        assert_eq!(
            e.message.as_deref(),
            Some("The specified log group does not exist.")
        );
        let e = json_error(
            r#"{"__type":"ThrottlingException:http://internal.amazon.com/coral/com.amazon.coral.availability/","Message":"Rate exceeded"}"#,
        );
        assert_eq!(e.code.as_deref(), Some("ThrottlingException"));
        assert_eq!(e.message.as_deref(), Some("Rate exceeded"));
        let refused = accept(
            "PutEvents",
            Reply {
                status: 400,
                body: r#"{"__type":"ThrottlingException","message":"slow"}"#.to_string(),
                request_id: Some("r-1".to_string()),
                error_type: None,
            },
            json_error,
        )
        .unwrap_err();
        assert!(refused.retryable, "{refused:?}");
        let refused = accept(
            "PutLogEvents",
            Reply {
                status: 400,
                body: "{}".to_string(),
                request_id: None,
                error_type: Some(
                    "ResourceNotFoundException:http://internal.amazon.com/coral/com.amazonaws.logs/"
                        .to_string(),
                ),
            },
            json_error,
        )
        .unwrap_err();
        assert_eq!(refused.code.as_deref(), Some("ResourceNotFoundException"));
        assert!(!refused.retryable);
        assert_eq!(
            json_error("<html>bad gateway</html>"),
            ServiceError::default()
        );
        assert_eq!(json_error(r#"{"__type":""}"#).code, None);
    }

    #[test]
    fn no_region_and_no_endpoint_is_said() {
        let sdk = SdkConfig::builder().build();
        let s = Service {
            id: "EC2",
            signing_name: "ec2",
        };
        assert!(
            endpoint(&sdk, s, None)
                .unwrap_err()
                .contains("no AWS region")
        );
        let sdk = SdkConfig::builder()
            .endpoint_url("http://127.0.0.1:5000")
            .build();
        assert_eq!(endpoint(&sdk, s, None).unwrap(), "http://127.0.0.1:5000");
    }
}
