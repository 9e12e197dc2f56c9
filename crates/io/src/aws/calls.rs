//! One place that knows how an AWS call went: every SDK error is classified retryable
//! (throttling, 5xx, timeouts, connection failures) or terminal (validation, permissions, a
//! missing resource), and every call that reached AWS leaves its request id in a `Calls` log,
//! so an incident can list each call with the id a support case or CloudTrail search needs.

use aws_sdk_ecs::config::http::HttpResponse;
use aws_sdk_ecs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_ecs::operation::RequestId;

/// Error codes AWS services use for throttling and transient server trouble.
const RETRYABLE_CODES: &[&str] = &[
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottledException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "RequestThrottled",
    "SlowDown",
    "PriorRequestNotComplete",
    "EC2ThrottledException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalFailure",
    "InternalError",
    "ServiceUnavailable",
    // ECS: "server-side issue"; Auto Scaling: another operation on the group is in progress.
    "ServerException",
    "ResourceContention",
];

/// Whether an AWS error code says the call may succeed later (throttling, server trouble).
pub fn retryable_code(code: &str) -> bool {
    RETRYABLE_CODES.contains(&code)
}

/// A failed AWS call, classified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {message}")]
pub struct CallError {
    /// The API operation, e.g. `PutAttributes`.
    pub op: &'static str,
    /// The service's error code, when it sent one (`ThrottlingException`, `ValidationError`).
    pub code: Option<String>,
    pub message: String,
    pub retryable: bool,
    pub request_id: Option<String>,
}

impl CallError {
    /// An error found in a successful response (`failures[]`) or in our own checks.
    pub fn terminal(op: &'static str, message: impl Into<String>) -> Self {
        CallError {
            op,
            code: None,
            message: message.into(),
            retryable: false,
            request_id: None,
        }
    }

    pub fn transient(op: &'static str, message: impl Into<String>) -> Self {
        CallError {
            retryable: true,
            ..CallError::terminal(op, message)
        }
    }

    /// Classifies an SDK error (both service crates share these types).
    pub fn from_sdk<E>(op: &'static str, err: SdkError<E, HttpResponse>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let request_id = err.request_id().map(str::to_string);
        let status = err.raw_response().map(|r| r.status().as_u16());
        let (code, message, retryable) = match &err {
            SdkError::ConstructionFailure(_) => (None, error_chain(&err), false),
            SdkError::TimeoutError(_) => (None, "timed out".to_string(), true),
            SdkError::DispatchFailure(d) => {
                let m = if d.is_timeout() {
                    "timed out connecting".to_string()
                } else {
                    error_chain(&err)
                };
                // A connector that is misconfigured (bad endpoint) will not heal by itself.
                (None, m, !d.is_user())
            }
            SdkError::ResponseError(_) => (
                None,
                format!(
                    "unreadable response (HTTP {}): {}",
                    status.map_or("?".to_string(), |s| s.to_string()),
                    error_chain(&err)
                ),
                status.is_some_and(|s| s >= 500 || s == 429),
            ),
            SdkError::ServiceError(se) => {
                let e = se.err();
                let code = e.code().map(str::to_string);
                let message = match (e.code(), e.message()) {
                    (Some(c), Some(m)) => format!("{c}: {m}"),
                    (Some(c), None) => c.to_string(),
                    (None, Some(m)) => m.to_string(),
                    (None, None) => {
                        format!("HTTP {}", status.map_or("?".to_string(), |s| s.to_string()))
                    }
                };
                let retryable = code.as_deref().is_some_and(retryable_code)
                    || status.is_some_and(|s| s >= 500 || s == 429);
                (code, message, retryable)
            }
            _ => (None, error_chain(&err), false),
        };
        CallError {
            op,
            code,
            message,
            retryable,
            request_id,
        }
    }
}

/// The error and its sources on one line ("dispatch failure: io error: connection refused").
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut src = err.source();
    while let Some(s) = src {
        let m = s.to_string();
        if !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        src = s.source();
    }
    out
}

/// The calls one order made, as `"<Operation> <request id>"` entries for the journal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Calls {
    pub entries: Vec<String>,
}

impl Calls {
    pub fn new() -> Self {
        Calls::default()
    }

    pub fn record(&mut self, op: &str, request_id: Option<&str>) {
        self.entries.push(match request_id {
            Some(id) => format!("{op} {id}"),
            None => format!("{op} (no request id)"),
        });
    }

    /// Records the outcome of one call and turns its error into a `CallError`.
    pub fn track<T, E>(
        &mut self,
        op: &'static str,
        result: Result<T, SdkError<E, HttpResponse>>,
    ) -> Result<T, CallError>
    where
        T: RequestId,
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        match result {
            Ok(out) => {
                self.record(op, out.request_id());
                Ok(out)
            }
            Err(e) => {
                let e = CallError::from_sdk(op, e);
                if let Some(id) = &e.request_id {
                    self.record(op, Some(id));
                }
                Err(e)
            }
        }
    }

    /// Like `track`, but a successful call is not recorded (polls, which would flood the
    /// journal); a failed one still is.
    pub fn quiet<T, E>(
        &mut self,
        op: &'static str,
        result: Result<T, SdkError<E, HttpResponse>>,
    ) -> Result<T, CallError>
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        result.map_err(|e| {
            let e = CallError::from_sdk(op, e);
            if let Some(id) = &e.request_id {
                self.record(op, Some(id));
            }
            e
        })
    }

    /// `track` for a call made without a service crate ([`super::signed`]): the id is read
    /// from the reply by `id`.
    pub fn track_signed<T>(
        &mut self,
        op: &'static str,
        result: Result<T, CallError>,
        id: impl Fn(&T) -> Option<&str>,
    ) -> Result<T, CallError> {
        match &result {
            Ok(out) => self.record(op, id(out)),
            Err(e) => {
                if let Some(rid) = &e.request_id {
                    self.record(op, Some(rid));
                }
            }
        }
        result
    }

    /// `quiet` for a call made without a service crate: only a failure is recorded.
    pub fn quiet_signed<T>(&mut self, result: Result<T, CallError>) -> Result<T, CallError> {
        if let Err(e) = &result
            && let Some(rid) = &e.request_id
        {
            self.record(e.op, Some(rid));
        }
        result
    }

    /// `quiet` for polls, `track` otherwise.
    pub fn track_unless<T, E>(
        &mut self,
        quiet: bool,
        op: &'static str,
        result: Result<T, SdkError<E, HttpResponse>>,
    ) -> Result<T, CallError>
    where
        T: RequestId,
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        if quiet {
            self.quiet(op, result)
        } else {
            self.track(op, result)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_name_the_operation() {
        let mut c = Calls::new();
        c.record("PutAttributes", Some("r-1"));
        c.record("StopTask", None);
        assert_eq!(c.entries, ["PutAttributes r-1", "StopTask (no request id)"]);
    }
}
