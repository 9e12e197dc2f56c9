//! Disruptions AWS plans for this instance, from IMDS (docs/planned-events.md): every
//! `[planned] poll_interval` the source reads, through the same IMDSv2 client and timeouts as
//! the lifecycle watcher (`crate::aws::imds`):
//!
//! - `events/maintenance/scheduled`: a JSON array of `{Code, Description, EventId, NotBefore,
//!   NotAfter, State}` (times like `21 Jan 2019 09:00:43 GMT`);
//! - `spot/instance-action`: `{"action": "terminate" | "stop" | "hibernate", "time": RFC 3339}`,
//!   404 when there is none;
//! - `events/recommendations/rebalance`: `{"noticeTime": RFC 3339}`, 404 when there is none.
//!
//! Each new event, and each change of an event's state or times, is one observation (a
//! `maintenance-event`, `spot-interruption` or `rebalance-recommendation`); a document that
//! did not change sends nothing. A Spot notice that is no longer listed (404 again) is one
//! `spot-notice-gone`. A scheduled event carries the kernel's boot id at the time
//! of reading (the supervisor's one reading at start, `[repair] boot_id_path`, handed in with
//! the source's [`crate::model::Resume`]), so the engine can tell that a reboot happened.
//!
//! What never decides anything, each said once in a warning until it changes: IMDS down or
//! refusing (retried with backoff), a document larger than `[planned] max_document` (its
//! text is not parsed), a document that is not the JSON described above (its first bytes are
//! quoted), an entry with a time or state that cannot be read. An event whose window already
//! ended is reported (the engine records it, drains nothing) with a warning here.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;

use aws_sdk_ecs::config::SharedHttpClient;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::aws::imds::{get_document, imds_client};
use crate::config::PlannedConfig;
use crate::model::{EventState, Observation, ScheduledEvent, Signal, Timestamp};
use crate::probe::Source;
use crate::probe::lifecycle::backoff;

/// The observations' source.
pub const SOURCE: &str = "imds-events";
pub const SCHEDULED_PATH: &str = "/latest/meta-data/events/maintenance/scheduled";
pub const SPOT_PATH: &str = "/latest/meta-data/spot/instance-action";
pub const REBALANCE_PATH: &str = "/latest/meta-data/events/recommendations/rebalance";
/// Bytes of a malformed document quoted in its warning.
const QUOTE: usize = 80;

/// Why a document decides nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DocError {
    #[error("document of {len} bytes exceeds [planned] max_document ({max} bytes): not parsed")]
    TooLarge { len: usize, max: usize },
    #[error("not the JSON IMDS documents ({why}); it begins {quote:?}")]
    Malformed { why: String, quote: String },
}

fn malformed(text: &str, why: impl std::fmt::Display) -> DocError {
    let mut end = text.len().min(QUOTE);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    DocError::Malformed {
        why: why.to_string(),
        quote: text[..end].to_string(),
    }
}

fn capped(text: &str, max: usize) -> Result<(), DocError> {
    if text.len() > max {
        return Err(DocError::TooLarge {
            len: text.len(),
            max,
        });
    }
    Ok(())
}

#[derive(Deserialize)]
struct RawEvent {
    #[serde(rename = "Code", default)]
    code: String,
    #[serde(rename = "Description", default)]
    description: String,
    #[serde(rename = "EventId", default)]
    event_id: String,
    #[serde(rename = "NotBefore", default)]
    not_before: String,
    #[serde(rename = "NotAfter", default)]
    not_after: String,
    #[serde(rename = "State", default)]
    state: String,
}

/// The scheduled events document: the events it names, and the entries that could not be
/// read (with why). `boot_id` is stamped on every event.
pub fn parse_scheduled(
    text: &str,
    max: usize,
    boot_id: &str,
) -> Result<(Vec<ScheduledEvent>, Vec<String>), DocError> {
    capped(text, max)?;
    let raw: Vec<RawEvent> = serde_json::from_str(text).map_err(|e| malformed(text, e))?;
    let mut out = Vec::new();
    let mut bad = Vec::new();
    for r in raw {
        let name = if r.event_id.is_empty() {
            format!("an event of code {:?}", r.code)
        } else {
            r.event_id.clone()
        };
        let Some(state) = EventState::parse(&r.state) else {
            bad.push(format!("{name}: unknown State {:?}", r.state));
            continue;
        };
        if r.code.trim().is_empty() {
            bad.push(format!("{name}: no Code"));
            continue;
        }
        let not_before = match parse_time(&r.not_before) {
            Ok(t) => t,
            Err(e) => {
                bad.push(format!("{name}: NotBefore {e}"));
                continue;
            }
        };
        let not_after = if r.not_after.trim().is_empty() {
            None
        } else {
            match parse_time(&r.not_after) {
                Ok(t) => Some(t),
                Err(e) => {
                    bad.push(format!("{name}: NotAfter {e}"));
                    continue;
                }
            }
        };
        out.push(ScheduledEvent {
            id: r.event_id,
            code: r.code.trim().to_string(),
            state,
            not_before,
            not_after,
            description: r.description.chars().take(256).collect(),
            boot_id: boot_id.to_string(),
        });
    }
    Ok((out, bad))
}

#[derive(Deserialize)]
struct RawSpot {
    action: String,
    time: String,
}

/// The Spot instance-action document: (action, time).
pub fn parse_spot(text: &str, max: usize) -> Result<(String, Timestamp), DocError> {
    capped(text, max)?;
    let r: RawSpot = serde_json::from_str(text).map_err(|e| malformed(text, e))?;
    let action = r.action.trim().to_ascii_lowercase();
    if !matches!(action.as_str(), "terminate" | "stop" | "hibernate") {
        return Err(malformed(text, format!("unknown action {:?}", r.action)));
    }
    let time = parse_time(&r.time).map_err(|e| malformed(text, format!("time {e}")))?;
    Ok((action, time))
}

#[derive(Deserialize)]
struct RawRebalance {
    #[serde(rename = "noticeTime")]
    notice_time: String,
}

/// The rebalance recommendation document: its notice time.
pub fn parse_rebalance(text: &str, max: usize) -> Result<Timestamp, DocError> {
    capped(text, max)?;
    let r: RawRebalance = serde_json::from_str(text).map_err(|e| malformed(text, e))?;
    parse_time(&r.notice_time).map_err(|e| malformed(text, format!("noticeTime {e}")))
}

const MONTHS: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];

/// An IMDS time: `21 Jan 2019 09:00:43 GMT` (scheduled events) or RFC 3339 (Spot,
/// rebalance).
pub fn parse_time(s: &str) -> Result<Timestamp, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("is empty".into());
    }
    if s.as_bytes().get(4) == Some(&b'-') {
        return Timestamp::parse(s);
    }
    let parts: Vec<&str> = s.split_whitespace().collect();
    let bad = || format!("{s:?} is not a time like \"21 Jan 2019 09:00:43 GMT\"");
    let [day, month, year, clock, zone] = parts.as_slice() else {
        return Err(bad());
    };
    if !matches!(zone.to_ascii_uppercase().as_str(), "GMT" | "UTC" | "Z") {
        return Err(bad());
    }
    let day: u32 = day.parse().map_err(|_| bad())?;
    let month = MONTHS
        .iter()
        .position(|m| month.to_ascii_lowercase().starts_with(m))
        .ok_or_else(bad)? as u32
        + 1;
    let year: i64 = year.parse().map_err(|_| bad())?;
    let hms: Vec<u32> = clock
        .split(':')
        .map(|x| x.parse().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let [h, m, sec] = hms.as_slice() else {
        return Err(bad());
    };
    if !(1970..=9999).contains(&year) || !(1..=31).contains(&day) || *h > 23 || *m > 59 || *sec > 60
    {
        return Err(bad());
    }
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + i64::from(*h) * 3600 + i64::from(*m) * 60 + i64::from(*sec);
    let ms = u64::try_from(secs).map_err(|_| bad())?.saturating_mul(1000);
    Ok(Timestamp(ms))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// What the source last reported, to send only what changed.
#[derive(Debug, Default)]
pub struct Seen {
    events: BTreeMap<String, (EventState, Timestamp, Option<Timestamp>)>,
    spot: Option<(String, Timestamp)>,
    rebalance: Option<Timestamp>,
    /// Problems already warned about, by path: said once until the document changes.
    warned: BTreeMap<&'static str, String>,
    past: BTreeSet<String>,
}

impl Seen {
    /// The observations for one reading of the three documents (`None`: 404). `now` only
    /// decides which events are warned about as past.
    pub fn read(
        &mut self,
        docs: [(&'static str, Option<&str>); 3],
        max: usize,
        boot: &str,
        now: Timestamp,
    ) -> Vec<Observation> {
        let mut out = Vec::new();
        for (path, doc) in docs {
            match (path, doc) {
                (SCHEDULED_PATH, Some(text)) => match parse_scheduled(text, max, boot) {
                    Ok((events, bad)) => {
                        if bad.is_empty() {
                            self.clear(path);
                        } else {
                            self.warn(path, format!("entries skipped: {}", bad.join("; ")));
                        }
                        for e in events {
                            out.extend(self.scheduled(e, now));
                        }
                    }
                    Err(e) => self.warn(path, e.to_string()),
                },
                (SPOT_PATH, Some(text)) => match parse_spot(text, max) {
                    Ok((action, time)) => {
                        self.clear(path);
                        if self.spot.as_ref() != Some(&(action.clone(), time)) {
                            self.spot = Some((action.clone(), time));
                            if time <= now {
                                tracing::warn!(
                                    probe = SOURCE,
                                    "IMDS spot/instance-action: {action} at {time} is in the past: nothing is drained"
                                );
                            }
                            out.push(
                                Observation::new(Signal::SpotInterruption { action, time })
                                    .with_detail(format!(
                                        "IMDS spot/instance-action = {}",
                                        crate::mps::control::clip(text.trim(), 256)
                                    ))
                                    .from_source(SOURCE),
                            );
                        }
                    }
                    Err(e) => self.warn(path, e.to_string()),
                },
                (REBALANCE_PATH, Some(text)) => match parse_rebalance(text, max) {
                    Ok(notice) => {
                        self.clear(path);
                        if self.rebalance != Some(notice) {
                            self.rebalance = Some(notice);
                            out.push(
                                Observation::new(Signal::RebalanceRecommendation { notice })
                                    .with_detail(format!(
                                        "IMDS events/recommendations/rebalance = {}",
                                        crate::mps::control::clip(text.trim(), 256)
                                    ))
                                    .from_source(SOURCE),
                            );
                        }
                    }
                    Err(e) => self.warn(path, e.to_string()),
                },
                (SPOT_PATH, None) => {
                    self.clear(path);
                    // The notice is gone while we still run: AWS did not take the instance
                    // (a Spot stop or hibernation it came back from).
                    if let Some((action, time)) = self.spot.take() {
                        tracing::info!(
                            probe = SOURCE,
                            "IMDS spot/instance-action: the {action} notice for {time} is no longer listed"
                        );
                        out.push(
                            Observation::new(Signal::SpotNoticeGone { action, time })
                                .with_detail("IMDS spot/instance-action is 404 again")
                                .from_source(SOURCE),
                        );
                    }
                }
                (_, None) => self.clear(path),
                _ => {}
            }
        }
        out
    }

    fn scheduled(&mut self, e: ScheduledEvent, now: Timestamp) -> Option<Observation> {
        let key = if e.id.is_empty() {
            format!("{}@{}", e.code, e.not_before)
        } else {
            e.id.clone()
        };
        let now_seen = (e.state, e.not_before, e.not_after);
        if self.events.get(&key) == Some(&now_seen) {
            return None;
        }
        if self.events.len() >= 256 && !self.events.contains_key(&key) {
            return None; // IMDS lists a few events; a flood is not followed
        }
        self.events.insert(key.clone(), now_seen);
        let end = e.not_after.unwrap_or(e.not_before);
        if e.state == EventState::Active && end <= now && self.past.insert(key.clone()) {
            tracing::warn!(probe = SOURCE, event_id = %key, code = %e.code, "IMDS lists scheduled event {key} ({}) whose window ended at {end}: an event in the past, nothing is drained", e.code);
        }
        tracing::info!(probe = SOURCE, event_id = %key, code = %e.code, state = e.state.as_str(), not_before = %e.not_before, "AWS scheduled event for this instance");
        let detail = format!(
            "IMDS events/maintenance/scheduled: {} {} {} NotBefore {}{}{}",
            key,
            e.code,
            e.state.as_str(),
            e.not_before,
            e.not_after
                .map(|t| format!(" NotAfter {t}"))
                .unwrap_or_default(),
            if e.description.is_empty() {
                String::new()
            } else {
                format!(": {}", e.description)
            }
        );
        Some(
            Observation::new(Signal::MaintenanceEvent { event: e })
                .with_detail(detail)
                .from_source(SOURCE),
        )
    }

    fn warn(&mut self, path: &'static str, why: String) {
        if self.warned.get(path) == Some(&why) {
            return;
        }
        tracing::warn!(
            probe = SOURCE,
            path,
            "IMDS {path}: {why}; nothing is decided on it"
        );
        self.warned.insert(path, why);
    }

    fn clear(&mut self, path: &'static str) {
        self.warned.remove(path);
    }
}

/// One reading of the three documents. Err: IMDS could not be asked (the first error).
/// Each document is read to at most `max + 1` bytes (a longer one is then refused by its
/// length, unparsed, and never held whole).
pub async fn read_docs(
    client: &crate::aws::imds::Client,
    max: usize,
) -> Result<[(&'static str, Option<String>); 3], crate::aws::imds::ImdsFailure> {
    let scheduled = get_document(client, SCHEDULED_PATH, max).await?;
    let spot = get_document(client, SPOT_PATH, max).await?;
    let rebalance = get_document(client, REBALANCE_PATH, max).await?;
    Ok([
        (SCHEDULED_PATH, scheduled),
        (SPOT_PATH, spot),
        (REBALANCE_PATH, rebalance),
    ])
}

/// The planned-events source for `gpu-medic run` (with `[aws]` and `[planned]` enabled).
pub struct PlannedSource {
    cfg: PlannedConfig,
    http: SharedHttpClient,
}

impl PlannedSource {
    pub fn new(cfg: PlannedConfig, http: SharedHttpClient) -> Self {
        PlannedSource { cfg, http }
    }

    async fn watch(self, tx: mpsc::Sender<Observation>, shutdown: CancellationToken, boot: String) {
        let client = imds_client(self.http.clone(), 2);
        if boot.is_empty() {
            tracing::warn!(
                probe = SOURCE,
                "the kernel boot id is unknown: a reboot after a scheduled event is not told apart, the instance then returns to service only once AWS completes it"
            );
        }
        let interval = self.cfg.poll_interval;
        let mut seen = Seen::default();
        let mut failures = 0u32;
        loop {
            let read = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = read_docs(&client, self.cfg.max_document) => r,
            };
            let delay = match read {
                Ok(docs) => {
                    if failures > 0 {
                        tracing::info!(
                            probe = SOURCE,
                            "IMDS answers again after {failures} failed poll(s)"
                        );
                    }
                    failures = 0;
                    let docs = docs.each_ref().map(|(p, d)| (*p, d.as_deref()));
                    for obs in seen.read(docs, self.cfg.max_document, &boot, Timestamp::now()) {
                        if tx.send(obs).await.is_err() {
                            return;
                        }
                    }
                    interval
                }
                Err(e) => {
                    if failures == 0 {
                        tracing::warn!(
                            probe = SOURCE,
                            "{e}; planned-events poll backs off (planned disruptions are seen once IMDS answers; nothing is drained for it)"
                        );
                    }
                    failures = failures.saturating_add(1);
                    backoff(interval, failures)
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }
}

impl Source for PlannedSource {
    fn name(&self) -> &'static str {
        SOURCE
    }

    fn run(
        self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        resume: crate::model::Resume,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let boot = resume.boot().to_string();
        Box::pin(async move { self.watch(tx, shutdown, boot).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = 64 * 1024;

    #[test]
    fn imds_times_parse_in_both_forms() {
        let t = parse_time("21 Jan 2019 09:00:43 GMT").unwrap();
        assert_eq!(t, Timestamp::parse("2019-01-21T09:00:43Z").unwrap());
        assert_eq!(
            parse_time("2017-09-18T08:22:00Z").unwrap(),
            Timestamp::parse("2017-09-18T08:22:00Z").unwrap()
        );
        assert_eq!(
            parse_time("29 Feb 2024 23:59:59 GMT").unwrap(),
            Timestamp::parse("2024-02-29T23:59:59Z").unwrap()
        );
        for bad in [
            "",
            "yesterday",
            "21 Foo 2019 09:00:43 GMT",
            "21 Jan 2019 25:00:00 GMT",
            "21 Jan 2019 09:00:43 PST",
            "99999999999999999999 Jan 2019 09:00:43 GMT",
        ] {
            assert!(parse_time(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_scheduled_document_parses_and_bad_entries_are_named() {
        let doc = r#"[
          {"NotBefore":"21 Jan 2019 09:00:43 GMT","Code":"system-reboot","Description":"scheduled reboot","EventId":"instance-event-0d59937288b749b32","NotAfter":"21 Jan 2019 09:17:23 GMT","State":"active"},
          {"NotBefore":"someday","Code":"instance-stop","EventId":"instance-event-2","State":"active"},
          {"NotBefore":"21 Jan 2019 09:00:43 GMT","Code":"instance-stop","EventId":"instance-event-3","State":"pending"}
        ]"#;
        let (events, bad) = parse_scheduled(doc, MAX, "boot-1").unwrap();
        assert_eq!(events.len(), 1);
        let e = &events[0];
        assert_eq!(e.code, "system-reboot");
        assert_eq!(e.state, EventState::Active);
        assert_eq!(e.boot_id, "boot-1");
        assert_eq!(
            e.not_after,
            Some(parse_time("21 Jan 2019 09:17:23 GMT").unwrap())
        );
        assert_eq!(bad.len(), 2, "{bad:?}");
        assert!(
            bad[0].contains("instance-event-2") && bad[1].contains("pending"),
            "{bad:?}"
        );
    }

    #[test]
    fn oversized_and_malformed_documents_decide_nothing() {
        let big = format!("[{}]", " ".repeat(10 * 1024 * 1024));
        assert!(matches!(
            parse_scheduled(&big, MAX, ""),
            Err(DocError::TooLarge { .. })
        ));
        let e = parse_scheduled("{not json", MAX, "").unwrap_err();
        assert!(e.to_string().contains("{not json"), "{e}");
        assert!(parse_spot(r#"{"action":"explode","time":"2017-09-18T08:22:00Z"}"#, MAX).is_err());
        assert!(parse_rebalance(r#"{"noticeTime":"later"}"#, MAX).is_err());
        let mut seen = Seen::default();
        let obs = seen.read(
            [
                (SCHEDULED_PATH, Some(&big)),
                (SPOT_PATH, Some("]")),
                (REBALANCE_PATH, Some("{}")),
            ],
            MAX,
            "",
            Timestamp(0),
        );
        assert!(obs.is_empty(), "{obs:?}");
    }

    #[test]
    fn only_changes_are_sent() {
        let doc = |state: &str, nb: &str| {
            format!(
                r#"[{{"NotBefore":"{nb}","Code":"instance-retirement","EventId":"e1","State":"{state}"}}]"#
            )
        };
        let mut seen = Seen::default();
        let now = Timestamp(0);
        let a = doc("active", "21 Jan 2030 09:00:00 GMT");
        let read = |seen: &mut Seen, d: &str| {
            seen.read(
                [
                    (SCHEDULED_PATH, Some(d)),
                    (SPOT_PATH, None),
                    (REBALANCE_PATH, None),
                ],
                MAX,
                "b",
                now,
            )
        };
        assert_eq!(read(&mut seen, &a).len(), 1, "posted");
        assert_eq!(read(&mut seen, &a).len(), 0, "unchanged");
        assert_eq!(
            read(&mut seen, &doc("active", "22 Jan 2030 09:00:00 GMT")).len(),
            1,
            "rescheduled"
        );
        assert_eq!(
            read(&mut seen, &doc("canceled", "22 Jan 2030 09:00:00 GMT")).len(),
            1,
            "canceled"
        );
        let spot = r#"{"action":"terminate","time":"2030-01-01T00:02:00Z"}"#;
        let s = seen.read(
            [
                (SCHEDULED_PATH, None),
                (SPOT_PATH, Some(spot)),
                (REBALANCE_PATH, None),
            ],
            MAX,
            "b",
            now,
        );
        assert!(
            matches!(s[0].signal, Signal::SpotInterruption { .. }),
            "{s:?}"
        );
        let s = seen.read(
            [
                (SCHEDULED_PATH, None),
                (SPOT_PATH, Some(spot)),
                (REBALANCE_PATH, None),
            ],
            MAX,
            "b",
            now,
        );
        assert!(s.is_empty());
        // 404 again while the instance runs: the notice is gone, said once.
        let gone = |seen: &mut Seen| {
            seen.read(
                [
                    (SCHEDULED_PATH, None),
                    (SPOT_PATH, None),
                    (REBALANCE_PATH, None),
                ],
                MAX,
                "b",
                now,
            )
        };
        let g = gone(&mut seen);
        assert!(
            matches!(&g[..], [o] if matches!(o.signal, Signal::SpotNoticeGone { .. })),
            "{g:?}"
        );
        assert!(gone(&mut seen).is_empty());
    }
}
