//! Text others wrote, shown safely: the one escaping every display of it goes through.
//!
//! A tenant picks its process's name (`comm`: up to 15 bytes, any byte but NUL, through
//! `prctl`), which the NVIDIA driver copies into its XID line; ECS task families and container
//! names, MPS log lines and the ECS agent's answers are text others chose too. gpu-medic keeps
//! that text as it came (the journal holds it JSON-escaped, as evidence) and escapes it where
//! it is shown, so that it cannot move on-call's cursor, clear a screen, start a line of its
//! own in a table, a log or a page, or turn the text around it right to left.
//!
//! [`escape`] writes every character a terminal or a line-oriented reader could act on in one
//! visible form, and the backslash itself, so the form cannot be forged:
//!
//! | character | shown as |
//! |---|---|
//! | `\` | `\\` |
//! | line feed, carriage return, tab | `\n`, `\r`, `\t` |
//! | other C0 controls (U+0000..U+001F, ESC among them) and DEL | `\x00`..`\x1f`, `\x7f` |
//! | C1 controls (U+0080..U+009F) | `\u{80}`..`\u{9f}` |
//! | line and paragraph separators | `\u{2028}`, `\u{2029}` |
//! | bidirectional controls (U+061C, U+200E, U+200F, U+202A..U+202E, U+2066..U+2069) | `\u{202e}`, ... |
//!
//! Everything else is written as it is. Two different texts never escape to the same output:
//! every backslash in the output starts one of these forms, and each form reads back to one
//! character. Escaping is not idempotent (escaping `\x1b` again gives `\\x1b`): escape once,
//! where the text is shown, never text already escaped.
//!
//! [`json_safe`] is the same set for JSON text: JSON already escapes the C0 controls, the
//! quote and the backslash, and leaves the rest of the set raw; it writes those as JSON's own
//! `\uXXXX`, so the document still decodes to the same values.

use std::borrow::Cow;
use std::fmt::{self, Write};

/// Whether [`escape`] writes `c` in an escaped form (the backslash included).
pub fn is_escaped(c: char) -> bool {
    c == '\\' || is_control(c)
}

/// The characters a terminal or a line-oriented reader can act on: C0, DEL, C1, the Unicode
/// line and paragraph separators and the bidirectional controls (Unicode's `Bidi_Control`).
/// Escaped text holds none of them.
pub fn is_control(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{1f}'
        | '\u{7f}'..='\u{9f}'
        | '\u{2028}' | '\u{2029}'
        | '\u{61c}' | '\u{200e}' | '\u{200f}'
        | '\u{202a}'..='\u{202e}'
        | '\u{2066}'..='\u{2069}')
}

/// `s` in its escaped form (see the module docs), as a value to format: `{}` writes it
/// without building a string first.
pub fn escape(s: &str) -> Escaped<'_> {
    Escaped(s)
}

/// Text shown escaped: see [`escape`]. Width, fill and precision are not applied (pad the
/// escaped text, or escape the padded line).
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a>(&'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Escaping(f).write_str(self.0)
    }
}

/// A writer that escapes everything written through it, as [`escape`] does: for output that
/// is formatted in pieces (a log line's fields, a command's line).
pub struct Escaping<W>(pub W);

impl<W: Write> Write for Escaping<W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut rest = s;
        while let Some(at) = rest.find(is_escaped) {
            self.0.write_str(&rest[..at])?;
            let Some(c) = rest[at..].chars().next() else {
                break;
            };
            match c {
                '\\' => self.0.write_str("\\\\")?,
                '\n' => self.0.write_str("\\n")?,
                '\r' => self.0.write_str("\\r")?,
                '\t' => self.0.write_str("\\t")?,
                c if c.is_ascii() => write!(self.0, "\\x{:02x}", u32::from(c))?,
                c => write!(self.0, "\\u{{{:x}}}", u32::from(c))?,
            }
            rest = &rest[at + c.len_utf8()..];
        }
        self.0.write_str(rest)
    }
}

/// JSON text with the characters of [`escape`]'s set that JSON leaves raw (DEL, C1, the line
/// and paragraph separators, the bidirectional controls) written as `\uXXXX`. For valid JSON
/// (those characters can only be inside its strings) it is valid JSON of the same value; its
/// whitespace, a final newline included, is kept.
pub fn json_safe(json: &str) -> Cow<'_, str> {
    // JSON escapes C0 itself (and a raw one can only be whitespace between tokens).
    let raw = |c: char| c > '\u{1f}' && is_control(c);
    if !json.contains(raw) {
        return Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if raw(c) {
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn esc(s: &str) -> String {
        escape(s).to_string()
    }

    /// Reads an escaped text back, as the module docs say to: the test of unambiguity.
    fn unescape(s: &str) -> Option<String> {
        let mut out = String::new();
        let mut it = s.chars();
        while let Some(c) = it.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            match it.next()? {
                '\\' => out.push('\\'),
                'n' => out.push('\n'),
                'r' => out.push('\r'),
                't' => out.push('\t'),
                'x' => {
                    let hex: String = it.by_ref().take(2).collect();
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                }
                'u' => {
                    if it.next()? != '{' {
                        return None;
                    }
                    let hex: String = it.by_ref().take_while(|c| *c != '}').collect();
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                }
                _ => return None,
            }
        }
        Some(out)
    }

    #[test]
    fn every_class_has_one_visible_form() {
        for (raw, shown) in [
            (
                "plain name-1_x:3 ünïcødé 日本",
                "plain name-1_x:3 ünïcødé 日本",
            ),
            ("a\\b", "a\\\\b"),
            ("\n\r\t", "\\n\\r\\t"),
            (
                "\u{0}\u{1}\u{7}\u{8}\u{b}\u{c}\u{1f}",
                "\\x00\\x01\\x07\\x08\\x0b\\x0c\\x1f",
            ),
            ("\u{1b}[2J\u{1b}[H", "\\x1b[2J\\x1b[H"),
            ("\u{1b}]0;title\u{7}", "\\x1b]0;title\\x07"),
            ("\u{7f}", "\\x7f"),
            ("\u{80}\u{85}\u{9b}\u{9f}", "\\u{80}\\u{85}\\u{9b}\\u{9f}"),
            ("\u{a0}\u{a9}", "\u{a0}\u{a9}"),
            ("\u{2028}\u{2029}", "\\u{2028}\\u{2029}"),
            (
                "\u{202a}\u{202b}\u{202c}\u{202d}\u{202e}",
                "\\u{202a}\\u{202b}\\u{202c}\\u{202d}\\u{202e}",
            ),
            (
                "\u{2066}\u{2067}\u{2068}\u{2069}",
                "\\u{2066}\\u{2067}\\u{2068}\\u{2069}",
            ),
            ("\u{61c}\u{200e}\u{200f}", "\\u{61c}\\u{200e}\\u{200f}"),
            ("\u{fffd}", "\u{fffd}"),
        ] {
            assert_eq!(esc(raw), shown, "{raw:?}");
            assert_eq!(unescape(shown).as_deref(), Some(raw), "{shown}");
        }
    }

    #[test]
    fn a_forged_escape_is_told_from_the_real_byte() {
        // A name that spells an escape in plain text reads differently from the byte itself.
        assert_ne!(esc("\\x1b"), esc("\u{1b}"));
        assert_eq!(esc("\\x1b"), "\\\\x1b");
        // Not idempotent, by design: escape once, where the text is shown.
        assert_ne!(esc(&esc("\u{1b}")), esc("\u{1b}"));
    }

    #[test]
    fn the_streaming_writer_is_the_same_escape() {
        let mut s = String::new();
        let mut w = Escaping(&mut s);
        w.write_str("a\u{1b}").unwrap();
        let line_break = '\n';
        write!(w, "{line_break}|{}", 5).unwrap();
        assert_eq!(s, "a\\x1b\\n|5");
    }

    #[test]
    fn json_safe_text_decodes_to_the_same_value_and_holds_no_control() {
        let v = serde_json::json!({
            "name": "x\u{1b}[2J\n\u{7f}\u{9b}\u{2028}\u{202e}\u{2066}\\\"y",
            "list": ["\u{85}", "plain"],
        });
        let text = serde_json::to_string(&v).unwrap() + "\n";
        let safe = json_safe(&text);
        assert!(safe.ends_with("}\n"), "the line's end is kept: {safe}");
        assert!(
            !safe.trim_end_matches('\n').contains(is_control),
            "{safe:?}"
        );
        let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
        assert_eq!(back, v);
        assert!(matches!(json_safe("{\"a\":\"b\"}"), Cow::Borrowed(_)));
    }

    /// Characters from every class, and ones that look like parts of an escape.
    fn alphabet() -> impl Strategy<Value = char> {
        prop_oneof![
            prop::sample::select(vec![
                '\\', 'x', 'u', '{', '}', '1', 'b', 'n', '\n', '\r', '\t', '\u{0}', '\u{1b}',
                '\u{7f}', '\u{80}', '\u{9b}', '\u{2028}', '\u{2029}', '\u{202e}', '\u{2066}',
                '\u{200f}', 'é', '日',
            ]),
            any::<char>(),
        ]
    }

    proptest! {
        /// Round trip: reading the escaped form back gives the text, so two different texts
        /// never escape to the same output; and the output holds no character of the set.
        #[test]
        fn escaping_is_unambiguous_and_leaves_no_control(
            a in prop::collection::vec(alphabet(), 0..24),
            b in prop::collection::vec(alphabet(), 0..24),
        ) {
            let (a, b): (String, String) = (a.into_iter().collect(), b.into_iter().collect());
            let (ea, eb) = (esc(&a), esc(&b));
            prop_assert!(!ea.contains(is_control), "{:?}", ea);
            prop_assert_eq!(unescape(&ea), Some(a.clone()));
            prop_assert_eq!(ea == eb, a == b);
        }
    }
}
