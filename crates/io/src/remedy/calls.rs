//! A remedy's view of a finished or failed series of AWS calls: the outcome carries every
//! request id the calls left (shared by the AWS remedies and the fleet budget).

use super::{Done, RemedyError};
use crate::aws::calls::{CallError, Calls};

pub trait CallsExt {
    /// The remedy's error for a failed call, carrying every request id so far.
    fn fail(self, err: CallError) -> RemedyError;
    fn fatal(self, message: impl Into<String>) -> RemedyError;
    fn done(self, detail: impl Into<String>) -> Done;
}

impl CallsExt for Calls {
    fn fail(self, err: CallError) -> RemedyError {
        let message = err.to_string();
        if err.retryable {
            RemedyError::Retryable {
                message,
                request_ids: self.entries,
            }
        } else {
            RemedyError::Fatal {
                message,
                request_ids: self.entries,
            }
        }
    }

    fn fatal(self, message: impl Into<String>) -> RemedyError {
        RemedyError::Fatal {
            message: message.into(),
            request_ids: self.entries,
        }
    }

    fn done(self, detail: impl Into<String>) -> Done {
        Done {
            detail: detail.into(),
            request_ids: self.entries,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_call_keeps_every_request_id_and_its_class() {
        let mut c = Calls::new();
        c.record("PutAttributes", Some("r-1"));
        c.record("StopTask", None);
        let RemedyError::Retryable { request_ids, .. } = c
            .clone()
            .fail(CallError::transient("StopTask", "slow down"))
        else {
            panic!("transient errors are retryable")
        };
        assert_eq!(request_ids.len(), 2);
        let RemedyError::Fatal { request_ids, .. } =
            c.fail(CallError::terminal("StopTask", "no such task"))
        else {
            panic!("terminal errors are fatal")
        };
        assert_eq!(request_ids.len(), 2);
    }
}
