//! The bounds the engine's records are held to by what reads them back.

/// One line of a JSON-lines journal (`incidents.jsonl`, `inputs.jsonl`, simulate input): every
/// record the engine writes must fit well inside it.
pub const MAX_JOURNAL_LINE: usize = 1024 * 1024;
