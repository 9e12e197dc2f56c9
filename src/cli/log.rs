//! The daemon's log as text or JSON lines, with text others wrote escaped.
//!
//! The log carries what tenants wrote: an incident's reason names the process and its task
//! (`incident opened: ... pid 42 <name>`), an order's detail quotes AWS and MPS messages. A
//! logged value must not start a log line of its own (a forged entry) nor move the reader's
//! terminal. tracing-subscriber (0.3.23 here; `tests` below pins what it does) escapes ESC,
//! BEL, BS, FF, DEL and C1 in an event's message only: a line break in a message, and any
//! control character in a field (`program = %name`), reach the text log raw; its JSON format
//! escapes C0 (JSON does) but leaves DEL, C1, the line separators and the bidirectional
//! controls raw. So:
//! - text ([`text`]): every field and message is written through [`crate::model::escape`]
//!   (one visible form, the same as the commands show), by [`EscapedFields`]; the level's
//!   colours are used only when stderr is a terminal;
//! - JSON ([`json`]): each line is written through [`crate::model::escape::json_safe`], so
//!   what JSON leaves raw is `\uXXXX` too, and the line still decodes to the same values.
//!
//! - journald ([`journald`]): tracing-journald writes each field's text as it is (journald's
//!   fields are binary-safe, and a line break in `MESSAGE` is a multi-line entry), so each
//!   event is handed to it again with every value escaped ([`EscapedEvents`]).

use std::fmt::{self, Write as _};
use std::io;

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber, span};
use tracing_subscriber::Layer;
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FormatFields, MakeWriter};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

use crate::model::escape::{Escaping, escape, json_safe};

/// Text lines to `writer`: fields and messages escaped ([`EscapedFields`]), coloured only when
/// `ansi`.
pub fn text<S, W>(writer: W, ansi: bool) -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt::layer()
        .fmt_fields(EscapedFields)
        .with_ansi(ansi)
        .with_writer(writer)
}

/// JSON lines to `writer`, each through [`json_safe`].
pub fn json<S, W>(writer: W) -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt::layer()
        .json()
        .with_writer(JsonSafe(writer))
}

/// journald's layer, each event's values escaped first ([`EscapedEvents`]).
pub fn journald(layer: tracing_journald::Layer) -> EscapedEvents<tracing_journald::Layer> {
    EscapedEvents(layer)
}

/// A layer that hands `L` every event with its values (the message included) escaped, as
/// text: the same event, callsite and parent, each value its escaped `Display` (a string) or
/// `Debug` (anything else). Spans are passed on as they are (gpu-medic opens none).
pub struct EscapedEvents<L>(L);

impl<S, L> Layer<S> for EscapedEvents<L>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    L: Layer<S>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        self.0.on_new_span(attrs, id, ctx);
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        self.0.on_record(id, values, ctx);
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut shown = Shown(Vec::new());
        event.record(&mut shown);
        let meta = event.metadata();
        let Some(first) = meta.fields().iter().next() else {
            return self.0.on_event(event, ctx);
        };
        let texts: Vec<(Field, &str)> = shown
            .0
            .iter()
            .map(|(f, t)| (f.clone(), t.as_str()))
            .collect();
        // A callsite has at most 32 fields (tracing's limit); the slots past them are empty.
        let values: [(&Field, Option<&dyn tracing::Value>); 32] = std::array::from_fn(|i| {
            texts
                .get(i)
                .map_or((&first, None), |(f, t)| (f, Some(t as &dyn tracing::Value)))
        });
        let set = meta.fields().value_set(&values);
        let escaped = match event.parent() {
            Some(parent) => Event::new_child_of(parent.clone(), meta, &set),
            None if event.is_root() => Event::new_child_of(None, meta, &set),
            None => Event::new(meta, &set),
        };
        self.0.on_event(&escaped, ctx);
    }
}

/// An event's values as escaped text.
struct Shown(Vec<(Field, String)>);

impl Visit for Shown {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.clone(), escape(value).to_string()));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let mut text = String::new();
        let _ = write!(Escaping(&mut text), "{value:?}");
        self.0.push((field.clone(), text));
    }
}

/// The text format's fields, an event's message first: `message key="str" key=value`, each
/// value escaped.
#[derive(Debug, Clone, Copy, Default)]
pub struct EscapedFields;

impl<'w> FormatFields<'w> for EscapedFields {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut v = FieldWriter {
            out: &mut writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut v);
        v.result
    }
}

struct FieldWriter<'a, 'w> {
    out: &'a mut Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl FieldWriter<'_, '_> {
    fn field(&mut self, field: &Field, value: fmt::Arguments<'_>) {
        if self.result.is_err() {
            return;
        }
        let sep = if std::mem::take(&mut self.first) {
            ""
        } else {
            " "
        };
        let name = field.name();
        let name = name.strip_prefix("r#").unwrap_or(name);
        self.result = match name {
            "message" => write!(self.out, "{sep}"),
            name => write!(self.out, "{sep}{name}="),
        }
        .and_then(|()| Escaping(&mut *self.out).write_fmt(value));
    }
}

impl Visit for FieldWriter<'_, '_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.field(field, format_args!("{value}"));
        } else {
            self.field(field, format_args!("\"{value}\""));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.field(field, format_args!("{value:?}"));
    }
}

/// A writer whose every write is one JSON log line, passed on through [`json_safe`].
pub struct JsonSafe<M>(M);

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for JsonSafe<M> {
    type Writer = JsonSafeWriter<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        JsonSafeWriter(self.0.make_writer())
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        JsonSafeWriter(self.0.make_writer_for(meta))
    }
}

/// See [`JsonSafe`]. tracing-subscriber writes each formatted event with one `write_all`.
pub struct JsonSafeWriter<W>(W);

impl<W: io::Write> io::Write for JsonSafeWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        self.0.write_all(json_safe(&text).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt;

    /// What the layers wrote.
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Buf {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    /// A process name as a tenant can set it: clear the screen, home the cursor, a forged
    /// log line, a carriage return, a right-to-left override, a C1 CSI.
    const NAME: &str = "\u{1b}[2J\u{1b}[H\nWARN forged: all clear\r\u{202e}\u{9b}31m";

    /// One event as the supervisor logs an incident (the name in its message and in fields
    /// of every kind), inside a span that carries it too.
    fn log_one(layer: impl Layer<tracing_subscriber::Registry> + Send + Sync + 'static) {
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("probe", source = NAME);
            let _in = span.enter();
            tracing::warn!(
                incident_id = 1,
                program = NAME,
                shown = %NAME,
                debug = ?NAME,
                "incident opened: program {NAME}"
            );
        });
    }

    /// What the layer `make` builds around a writer writes for [`log_one`]'s event.
    fn written<L>(make: impl FnOnce(Buf) -> L) -> String
    where
        L: Layer<tracing_subscriber::Registry> + Send + Sync + 'static,
    {
        let buf = Buf::default();
        log_one(make(buf.clone()));
        buf.text()
    }

    /// Pins what the installed tracing-subscriber does on its own, which is why this module
    /// exists: if an upgrade changes it, this fails and the module's docs are read again.
    #[test]
    fn the_stock_text_format_keeps_line_breaks_and_field_escapes_raw() {
        let out = written(|w| {
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(move || w.clone())
        });
        // The message's ESC is escaped, its line break is not: a forged line.
        assert!(out.contains("incident opened: program \\x1b[2J"), "{out}");
        assert!(out.contains("\nWARN forged: all clear"), "{out}");
        // A field's value keeps its ESC raw.
        assert!(out.contains("shown=\u{1b}[2J"), "{out}");
    }

    #[test]
    fn the_stock_json_format_leaves_separators_bidi_and_c1_raw() {
        let out = written(|w| {
            tracing_subscriber::fmt::layer()
                .json()
                .with_writer(move || w.clone())
        });
        assert_eq!(out.lines().count(), 1, "{out}");
        assert!(out.contains('\u{202e}') && out.contains('\u{9b}'), "{out}");
    }

    /// No control character but the line's end, whatever the values hold.
    fn assert_clean(out: &str, lines: usize) {
        assert!(out.ends_with('\n'), "{out}");
        assert_eq!(out.matches('\n').count(), lines, "{out}");
        let bad: Vec<char> = out
            .chars()
            .filter(|c| *c != '\n' && crate::model::escape::is_control(*c))
            .collect();
        assert!(bad.is_empty(), "{bad:?} in {out}");
    }

    #[test]
    fn the_text_log_escapes_every_field_and_message_in_one_line() {
        let out = written(|w| text(move || w.clone(), false));
        assert_clean(&out, 1);
        let shown = "\\x1b[2J\\x1b[H\\nWARN forged: all clear\\r\\u{202e}\\u{9b}31m";
        for want in [
            format!("incident opened: program {shown}"),
            format!("program=\"{shown}\""),
            format!("shown={shown}"),
            format!("source=\"{shown}\""),
            "incident_id=1".to_string(),
        ] {
            assert!(out.contains(&want), "{want} not in {out}");
        }
        // With colours (a terminal), only the level's own sequences are raw.
        let out = written(|w| text(move || w.clone(), true));
        assert!(
            !out.contains("\u{1b}[2J") && !out.contains("\u{9b}"),
            "{out}"
        );
        assert_eq!(out.matches('\n').count(), 1, "{out}");
    }

    #[test]
    fn the_json_log_is_one_line_of_the_same_values_without_a_raw_control() {
        let out = written(|w| json(move || w.clone()));
        assert_clean(&out, 1);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["fields"]["program"], NAME, "{v:#}");
        assert_eq!(v["span"]["source"], NAME, "{v:#}");
    }

    /// What a layer behind [`EscapedEvents`] is handed: each event's fields as text.
    #[derive(Clone, Default)]
    struct Handed(Arc<Mutex<Vec<Fields>>>);

    /// One event's fields: (name, value as text).
    type Fields = Vec<(String, String)>;

    impl<S: Subscriber> Layer<S> for Handed {
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            struct V(Vec<(String, String)>);
            impl Visit for V {
                fn record_str(&mut self, f: &Field, v: &str) {
                    self.0.push((f.name().into(), v.into()));
                }
                fn record_debug(&mut self, f: &Field, v: &dyn fmt::Debug) {
                    self.0.push((f.name().into(), format!("{v:?}")));
                }
            }
            let mut v = V(Vec::new());
            event.record(&mut v);
            self.0.lock().unwrap().push(v.0);
        }
    }

    #[test]
    fn journald_is_handed_every_value_escaped_and_plain_values_as_they_were() {
        let handed = Handed::default();
        log_one(EscapedEvents(handed.clone()));
        let events = handed.0.lock().unwrap().clone();
        assert_eq!(events.len(), 1, "{events:?}");
        let shown = "\\x1b[2J\\x1b[H\\nWARN forged: all clear\\r\\u{202e}\\u{9b}31m";
        let get = |k: &str| {
            events[0]
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        assert_eq!(get("message"), format!("incident opened: program {shown}"));
        assert_eq!(get("program"), shown);
        assert_eq!(get("shown"), shown);
        assert_eq!(get("incident_id"), "1");
        assert_eq!(
            get("debug"),
            "\"\\\\u{1b}[2J\\\\u{1b}[H\\\\nWARN forged: all clear\\\\r\\\\u{202e}\\\\u{9b}31m\"",
            "a Debug value's own escapes, their backslashes escaped"
        );
        for (_, v) in &events[0] {
            assert!(!v.contains(crate::model::escape::is_control), "{v:?}");
        }
    }
}
