//! The instance metadata service (IMDSv2), spoken directly (session token with its TTL
//! header; `AWS_EC2_METADATA_SERVICE_ENDPOINT` honoured), every answer capped at
//! [`MAX_BODY`] as it is read: the instance id and type, Auto Scaling's target lifecycle
//! state (read by the lifecycle probe, and by a running drain that must learn of a
//! termination beginning mid-drain), and the planned-events documents.

use std::time::Duration;

use aws_sdk_ecs::config::SharedHttpClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

/// The IMDS path of the target lifecycle state.
pub const TARGET_STATE_PATH: &str = "/latest/meta-data/autoscaling/target-lifecycle-state";
/// The IMDS path of the instance id.
pub const INSTANCE_ID_PATH: &str = "/latest/meta-data/instance-id";
/// The IMDS path of the instance type (`p5.48xlarge`).
pub const INSTANCE_TYPE_PATH: &str = "/latest/meta-data/instance-type";

/// The IMDS path of the instance tag that allows `gpu-medic drill` (instance tags in
/// metadata must be on for the instance).
pub const DRILL_TAG_PATH: &str = "/latest/meta-data/tags/instance/gpu-medic:drills";

/// The most of any IMDS answer read: IMDS documents are a few hundred bytes (a scheduled
/// events list a few KiB). A longer answer is refused as it is read, never held whole.
pub const MAX_BODY: usize = 64 * 1024;
/// The most of an answer's status line and headers read.
const MAX_HEAD: usize = 16 * 1024;
/// How long a session token is asked to live; it is renewed a minute before it ends.
const TOKEN_TTL_SECS: u64 = 21_600;

/// What asking IMDS went wrong with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("IMDS {path}: {message}")]
pub struct ImdsFailure {
    pub path: &'static str,
    pub message: String,
}

/// An IMDSv2 client of gpu-medic's own: a session token (`PUT /latest/api/token`, renewed
/// before its TTL ends), short timeouts (IMDS is local, and a poll must not outlast the
/// interval by much), and every answer read to at most [`MAX_BODY`] bytes as it arrives, so
/// an answer of megabytes costs neither memory nor a log line of its size. The endpoint is
/// `AWS_EC2_METADATA_SERVICE_ENDPOINT`, else `[fd00:ec2::254]` with
/// `AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE=IPv6`, else `169.254.169.254`, port 80
/// (`AWS_EC2_METADATA_DISABLED` is the SDK's credential chain's switch, as before: it does
/// not turn off gpu-medic's own reads).
#[derive(Debug, Clone)]
pub struct Client {
    endpoint: Result<Endpoint, String>,
    max_attempts: u32,
    /// Shared by clones: one token for all.
    token: std::sync::Arc<tokio::sync::Mutex<Option<(String, Instant)>>>,
}

#[derive(Debug, Clone)]
struct Endpoint {
    /// What to connect to: `host:port` (an IPv6 host in brackets).
    addr: String,
    /// The `Host` header.
    host: String,
}

fn endpoint_from_env() -> Result<Endpoint, String> {
    let url = match std::env::var("AWS_EC2_METADATA_SERVICE_ENDPOINT") {
        Ok(u) if !u.trim().is_empty() => u.trim().to_string(),
        _ if std::env::var("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE")
            .is_ok_and(|m| m.eq_ignore_ascii_case("ipv6")) =>
        {
            "http://[fd00:ec2::254]".to_string()
        }
        _ => "http://169.254.169.254".to_string(),
    };
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(format!(
            "IMDS endpoint {url:?}: only http:// is spoken (IMDS is a local, plain-HTTP service)"
        ));
    };
    let host = rest.split('/').next().unwrap_or_default().to_string();
    if host.is_empty() {
        return Err(format!("IMDS endpoint {url:?} names no host"));
    }
    let has_port = match host.rfind(']') {
        Some(b) => host[b..].contains(':'),
        None => host.contains(':'),
    };
    let addr = if has_port {
        host.clone()
    } else {
        format!("{host}:80")
    };
    Ok(Endpoint { addr, host })
}

/// An IMDSv2 client; `_http` is unused (kept for the callers' shape: IMDS is plain HTTP on a
/// link-local address, spoken here directly so that every answer is capped as it is read).
pub fn imds_client(_http: SharedHttpClient, max_attempts: u32) -> Client {
    Client {
        endpoint: endpoint_from_env(),
        max_attempts: max_attempts.max(1),
        token: std::sync::Arc::new(tokio::sync::Mutex::new(None)),
    }
}

/// One answer: the status and the body (at most [`MAX_BODY`] bytes).
#[derive(Debug)]
struct Answer {
    status: u16,
    body: Vec<u8>,
}

impl Client {
    /// One HTTP/1.1 exchange (connection closed after it), within 1 s to connect and 2 s
    /// for the answer.
    async fn exchange(
        &self,
        method: &str,
        path: &str,
        header: (&str, &str),
        cap: usize,
        cut: bool,
    ) -> Result<Answer, String> {
        let ep = self.endpoint.as_ref().map_err(Clone::clone)?;
        let mut stream = tokio::time::timeout(
            Duration::from_secs(1),
            tokio::net::TcpStream::connect(&ep.addr),
        )
        .await
        .map_err(|_| format!("connecting to {} timed out", ep.addr))?
        .map_err(|e| format!("connecting to {}: {e}", ep.addr))?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\n{}: {}\r\nAccept: */*\r\nUser-Agent: gpu-medic\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            ep.host, header.0, header.1
        );
        let talk = async {
            stream
                .write_all(request.as_bytes())
                .await
                .map_err(|e| format!("sending: {e}"))?;
            read_answer(&mut stream, cap, cut).await
        };
        tokio::time::timeout(Duration::from_secs(2), talk)
            .await
            .map_err(|_| "no answer within 2s".to_string())?
    }

    /// A session token, asked for when there is none or it is about to end.
    async fn token(&self, renew: bool) -> Result<String, String> {
        let mut held = self.token.lock().await;
        if !renew
            && let Some((t, until)) = held.as_ref()
            && Instant::now() < *until
        {
            return Ok(t.clone());
        }
        let a = self
            .exchange(
                "PUT",
                "/latest/api/token",
                (
                    "X-aws-ec2-metadata-token-ttl-seconds",
                    &TOKEN_TTL_SECS.to_string(),
                ),
                MAX_HEAD,
                false,
            )
            .await?;
        if a.status != 200 {
            return Err(format!("token request answered {}", a.status));
        }
        let t = String::from_utf8(a.body)
            .map_err(|_| "the token is not text".to_string())?
            .trim()
            .to_string();
        if t.is_empty() {
            return Err("empty token".into());
        }
        let until = Instant::now() + Duration::from_secs(TOKEN_TTL_SECS - 60);
        *held = Some((t.clone(), until));
        Ok(t)
    }

    /// GET `path` with a token: Ok(None) on 404; a 401 renews the token once.
    async fn get_once(
        &self,
        path: &str,
        cap: usize,
        cut: bool,
    ) -> Result<Option<Vec<u8>>, (String, bool)> {
        let mut renew = false;
        for _ in 0..2 {
            let token = self.token(renew).await.map_err(|e| (e, true))?;
            let a = self
                .exchange("GET", path, ("X-aws-ec2-metadata-token", &token), cap, cut)
                .await
                .map_err(|e| (e, true))?;
            match a.status {
                200 => return Ok(Some(a.body)),
                404 => return Ok(None),
                401 => renew = true,
                s => return Err((format!("answered {s}"), s >= 500 || s == 429)),
            }
        }
        Err(("the token was refused twice (401)".into(), true))
    }
}

/// Reads one HTTP/1.1 answer from `r`: the head (at most [`MAX_HEAD`]), then the body by
/// `Content-Length`, chunks, or to the end, refused past [`MAX_BODY`] as it is read.
async fn read_answer<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    cap: usize,
    cut: bool,
) -> Result<Answer, String> {
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > MAX_HEAD {
            return Err(format!("the answer's head is over {MAX_HEAD} bytes"));
        }
        let n = r
            .read(&mut chunk)
            .await
            .map_err(|e| format!("reading: {e}"))?;
        if n == 0 {
            return Err("the connection closed before the answer's head ended".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut rest = buf[head_end + 4..].to_vec();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| "not an HTTP answer".to_string())?;
    let mut length: Option<usize> = None;
    let mut chunked = false;
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("content-length") {
            length = Some(v.parse().map_err(|_| "a bad Content-Length".to_string())?);
        } else if k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        }
    }
    let too_long = || format!("the answer is longer than {cap} bytes: refused unread");
    if !cut && length.is_some_and(|n| n > cap) {
        return Err(too_long());
    }
    // The raw body (chunk framing included), read to its end or past the cap. `cut`: what
    // is past the cap is not read, and the answer is its first `cap + 1` bytes.
    let raw_cap = if chunked { cap * 2 + 4096 } else { cap };
    loop {
        if length.is_some_and(|n| rest.len() >= n) {
            break;
        }
        if rest.len() > raw_cap {
            if cut {
                break;
            }
            return Err(too_long());
        }
        let n = r
            .read(&mut chunk)
            .await
            .map_err(|e| format!("reading: {e}"))?;
        if n == 0 {
            break;
        }
        rest.extend_from_slice(&chunk[..n]);
    }
    let mut body = if chunked {
        dechunk(&rest, raw_cap).ok_or_else(|| "a bad chunked body".to_string())?
    } else {
        if let Some(n) = length {
            rest.truncate(n);
        }
        rest
    };
    if body.len() > cap {
        if !cut {
            return Err(too_long());
        }
        body.truncate(cap + 1);
    }
    Ok(Answer { status, body })
}

/// The data of a chunked body; None if its framing is broken.
fn dechunk(raw: &[u8], cap: usize) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        let line_end = raw[i..].windows(2).position(|w| w == b"\r\n")? + i;
        let size_text = std::str::from_utf8(&raw[i..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        i = line_end + 2;
        if size == 0 {
            return Some(out);
        }
        let Some(data) = raw.get(i..i + size) else {
            // Cut short at the cap: what arrived.
            out.extend_from_slice(raw.get(i..)?);
            return Some(out);
        };
        if out.len() + size > cap {
            out.extend_from_slice(data);
            return Some(out);
        }
        out.extend_from_slice(data);
        i += size + 2;
    }
}

/// GETs an IMDS path. Ok(None): 404 (not there on this instance). The answer is at most
/// [`MAX_BODY`] bytes (a longer one is a failure, never read whole) and trimmed.
pub async fn get(client: &Client, path: &'static str) -> Result<Option<String>, ImdsFailure> {
    Ok(fetch(client, path, MAX_BODY, false)
        .await?
        .map(|t| t.trim().to_string()))
}

/// GETs an IMDS document as it came (untrimmed), read to at most `cap + 1` bytes: a longer
/// document is its first `cap + 1` bytes, never read whole, for the caller's own cap to
/// refuse by its length.
pub async fn get_document(
    client: &Client,
    path: &'static str,
    cap: usize,
) -> Result<Option<String>, ImdsFailure> {
    fetch(client, path, cap, true).await
}

async fn fetch(
    client: &Client,
    path: &'static str,
    cap: usize,
    cut: bool,
) -> Result<Option<String>, ImdsFailure> {
    let fail = |message: String| ImdsFailure { path, message };
    let mut delay = Duration::from_millis(100);
    let mut attempt = 1;
    loop {
        match client.get_once(path, cap, cut).await {
            Ok(None) => return Ok(None),
            Ok(Some(body)) if body.len() > cap => {
                return Ok(Some(String::from_utf8_lossy(&body).into_owned()));
            }
            Ok(Some(body)) => {
                return String::from_utf8(body)
                    .map(Some)
                    .map_err(|_| fail("the answer is not text".into()));
            }
            Err((why, retryable)) => {
                if !retryable || attempt >= client.max_attempts {
                    return Err(fail(why));
                }
            }
        }
        attempt += 1;
        tokio::time::sleep(delay).await;
        delay *= 2;
    }
}

/// The instance id from IMDSv2, retried with backoff until `deadline` (IMDS may come up after
/// us at boot). The one instance-id lookup: identity discovery and the launch gate use it.
pub async fn instance_id(http: SharedHttpClient, deadline: Instant) -> Result<String, String> {
    let client = imds_client(http, 2);
    let mut delay = Duration::from_millis(500);
    loop {
        let err = match get(&client, INSTANCE_ID_PATH).await {
            Ok(Some(id)) if !id.is_empty() => return Ok(id),
            Ok(_) => "IMDS has no instance-id".to_string(),
            Err(e) => e.to_string(),
        };
        if Instant::now() + delay >= deadline {
            return Err(err);
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// The instance type from IMDSv2 (one attempt with the client's own retry). Ok(None): IMDS
/// has none.
pub async fn instance_type(http: SharedHttpClient) -> Result<Option<String>, ImdsFailure> {
    let client = imds_client(http, 2);
    Ok(get(&client, INSTANCE_TYPE_PATH)
        .await?
        .filter(|t| !t.is_empty()))
}

/// Whether IMDS says Auto Scaling is terminating the instance (target lifecycle state
/// `Terminated`). Asked by the drain itself on every poll: the lifecycle probe shares its
/// readings with the engine only.
pub async fn target_terminated(client: &Client) -> Result<bool, ImdsFailure> {
    Ok(get(client, TARGET_STATE_PATH).await?.as_deref() == Some("Terminated"))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn answer(raw: &[u8], cap: usize, cut: bool) -> Result<Answer, String> {
        let mut r = raw;
        read_answer(&mut r, cap, cut).await
    }

    #[tokio::test]
    async fn answers_are_capped_as_they_are_read() {
        let ok = answer(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
            64,
            false,
        )
        .await
        .unwrap();
        assert_eq!((ok.status, ok.body.as_slice()), (200, &b"hello"[..]));
        let big = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", 64 << 20);
        assert!(
            answer(big.as_bytes(), 64, false)
                .await
                .unwrap_err()
                .contains("longer")
        );
        let mut endless = b"HTTP/1.1 200 OK\r\n\r\n".to_vec();
        endless.extend(std::iter::repeat_n(b' ', 1 << 20));
        assert!(answer(&endless, 64, false).await.is_err());
        let cut = answer(&endless, 64, true).await.unwrap();
        assert_eq!(cut.body.len(), 65, "the first cap + 1 bytes");
        let chunked = answer(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            64,
            false,
        )
        .await
        .unwrap();
        assert_eq!(chunked.body, b"hello");
    }
}
