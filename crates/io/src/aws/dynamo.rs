//! The fleet budget's coordination store: one DynamoDB item per Auto Scaling group holding
//! the group's slot holders (models/README.md, "Slot protocol: implementation contract").
//!
//! Two calls only: `GetItem` with `ConsistentRead = true` (an eventually consistent read may
//! return an old version for ever, and the removal of a terminated holder depends on seeing
//! the current one), and `PutItem` of the whole item, always conditional on the version read
//! (`#v = :v`, or `attribute_not_exists(#g)` when there was no item). Nothing here decides:
//! the rules are in `remedy::aws::slots`. Every failure is typed, so the caller can tell a
//! lost race (re-read and decide again) from throttling and an unreachable table (no drain,
//! retry later) and from a mistake (a missing table, a missing permission).

use std::collections::{BTreeMap, HashMap};

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::types::AttributeValue;

use super::calls::{CallError, Calls};

/// The item's attribute names (the table's partition key is `group`, a String).
pub mod attr {
    pub const GROUP: &str = "group";
    pub const VERSION: &str = "version";
    pub const HOLDERS: &str = "holders";
    pub const BUDGET: &str = "budget";
    pub const UPDATED_BY: &str = "updated_by";
    pub const MEMBERS: &str = "members";
    pub const STATE: &str = "state";
    pub const TOKEN: &str = "token";
    pub const INCIDENT: &str = "incident";
    pub const SINCE: &str = "since";
    /// The fleet document's JSON text (item `<group>#fleet`).
    pub const DOC: &str = "doc";
}

/// A holder's entry: reserved (not yet allowed to act) or committed (acting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HolderState {
    Reserved,
    Committed,
}

impl HolderState {
    pub fn as_str(self) -> &'static str {
        match self {
            HolderState::Reserved => "reserved",
            HolderState::Committed => "committed",
        }
    }
}

/// One entry of `holders`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Holder {
    pub state: HolderState,
    /// The version its writer wrote: the fencing token.
    pub token: u64,
    /// For people only: the incident the holder acts for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incident: Option<String>,
    /// For people only: the writer's wall clock (RFC 3339); never compared by anyone.
    pub since: String,
}

/// The group's item as read: `version` 0 and no holders when there is no item.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlotItem {
    pub version: u64,
    /// Whether the item exists (a write to a missing item is `attribute_not_exists`).
    pub exists: bool,
    /// Instance id -> entry (ordered, so what people read is stable).
    pub holders: BTreeMap<String, Holder>,
    /// For people only: the budget its last writer enforced, and who that was.
    pub budget: Option<u32>,
    pub updated_by: Option<String>,
    /// The group's desired capacity as the last instance that wanted a slot read it: paces the
    /// sweep for terminated holders (about [`SWEEPS_PER_PERIOD`] sweeps per `retry_after` for
    /// the whole group, whatever its size). Never part of a decision.
    pub members: Option<u32>,
}

/// How many sweeps for terminated holders a group makes per `retry_after`, all its instances
/// together: each sweeps every `retry_after x members / SWEEPS_PER_PERIOD` (at least every
/// `retry_after`), so 1,000 healthy instances make about 5 reads a minute, not 1,000.
pub const SWEEPS_PER_PERIOD: u32 = 5;

/// Why a table call did not go through.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// The item changed since it was read (ConditionalCheckFailedException): read again and
    /// decide again. Not a failure of the table.
    #[error("the item changed since it was read (ConditionalCheckFailedException)")]
    Conflict,
    /// Throttling (ProvisionedThroughputExceededException, ThrottlingException,
    /// RequestLimitExceeded) or a server error: retry later.
    #[error("table throttled: {0}")]
    Throttled(CallError),
    /// No answer (connection refused, timeout, DNS): retry later.
    #[error("table unreachable: {0}")]
    Unreachable(CallError),
    /// A request the table will keep refusing: no such table, no permission, a bad key.
    #[error("table refused the call: {0}")]
    Refused(CallError),
    /// The item holds something this version cannot read (written by hand, or by another
    /// tool); nothing is overwritten.
    #[error("the item of group {group} is unreadable: {why}")]
    Malformed { group: String, why: String },
}

impl TableError {
    /// Whether trying again later may succeed without anyone changing anything.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            TableError::Conflict | TableError::Throttled(_) | TableError::Unreachable(_)
        )
    }

    /// A failed call, classified.
    pub fn from_call(e: CallError) -> Self {
        match e.code.as_deref() {
            Some("ConditionalCheckFailedException") => TableError::Conflict,
            Some(
                "ProvisionedThroughputExceededException"
                | "ThrottlingException"
                | "RequestLimitExceeded"
                | "LimitExceededException",
            ) => TableError::Throttled(e),
            Some(_) if e.retryable => TableError::Throttled(e),
            Some(_) => TableError::Refused(e),
            // No error code: the service never answered (or answered nothing readable).
            None if e.retryable => TableError::Unreachable(e),
            None => TableError::Refused(e),
        }
    }
}

/// One table: `[fleet] table`.
#[derive(Debug, Clone)]
pub struct SlotTable {
    pub client: Client,
    pub table: String,
}

impl SlotTable {
    /// A client of `table` with the SDK's configuration (the commands have no SDK crate).
    pub fn from_sdk(sdk: &aws_config::SdkConfig, table: impl Into<String>) -> Self {
        SlotTable::new(Client::new(sdk), table)
    }

    pub fn new(client: Client, table: impl Into<String>) -> Self {
        SlotTable {
            client,
            table: table.into(),
        }
    }

    /// GetItem (ConsistentRead) of `group`'s item; a missing item is version 0, no holders.
    pub async fn read(&self, calls: &mut Calls, group: &str) -> Result<SlotItem, TableError> {
        let r = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(attr::GROUP, AttributeValue::S(group.to_string()))
            .consistent_read(true)
            .send()
            .await;
        let r = calls.track("GetItem", r).map_err(TableError::from_call)?;
        match r.item() {
            None => Ok(SlotItem::default()),
            Some(item) => parse_item(group, item),
        }
    }

    /// PutItem of `new` (its `version` is `read.version + 1`), conditional on `read`'s version:
    /// `attribute_not_exists(#g)` when `read` found no item, `#v = :v` otherwise.
    pub async fn write(
        &self,
        calls: &mut Calls,
        group: &str,
        read: &SlotItem,
        new: &SlotItem,
    ) -> Result<(), TableError> {
        let mut put = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(item_attributes(group, new)));
        put = if read.exists {
            put.condition_expression("#v = :v")
                .expression_attribute_names("#v", attr::VERSION)
                .expression_attribute_values(":v", AttributeValue::N(read.version.to_string()))
        } else {
            put.condition_expression("attribute_not_exists(#g)")
                .expression_attribute_names("#g", attr::GROUP)
        };
        let r = put.send().await;
        calls
            .track("PutItem", r)
            .map(|_| ())
            .map_err(TableError::from_call)
    }
}

/// The suffix of the group's second item, its fleet document (fleet incidents,
/// `remedy::budget::patterns`): partition key `<group>#fleet`, beside the slot item.
pub const FLEET_SUFFIX: &str = "#fleet";
/// The largest fleet document read or written (DynamoDB's item limit is 400 KB).
pub const MAX_FLEET_DOC: usize = 256 * 1024;

/// The group's fleet document as read: its version (0: no item) and its JSON text (`{}`
/// when there is no item).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FleetItem {
    pub version: u64,
    pub exists: bool,
    pub doc: String,
}

impl SlotTable {
    /// GetItem (ConsistentRead) of `group`'s fleet document.
    pub async fn read_fleet(
        &self,
        calls: &mut Calls,
        group: &str,
    ) -> Result<FleetItem, TableError> {
        let key = format!("{group}{FLEET_SUFFIX}");
        let r = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(attr::GROUP, AttributeValue::S(key.clone()))
            .consistent_read(true)
            .send()
            .await;
        let r = calls.track("GetItem", r).map_err(TableError::from_call)?;
        let Some(item) = r.item() else {
            return Ok(FleetItem {
                doc: "{}".into(),
                ..FleetItem::default()
            });
        };
        let bad = |why: &str| TableError::Malformed {
            group: key.clone(),
            why: why.to_string(),
        };
        let version = fencing_version(item.get(attr::VERSION)).map_err(|why| bad(&why))?;
        let doc = item
            .get(attr::DOC)
            .and_then(|v| v.as_s().ok())
            .filter(|d| d.len() <= MAX_FLEET_DOC)
            .ok_or_else(|| bad("no readable document (or one over 256 KiB)"))?;
        Ok(FleetItem {
            version,
            exists: true,
            doc: doc.clone(),
        })
    }

    /// PutItem of `group`'s fleet document `doc` at version `read.version + 1`, conditional
    /// on `read` as the slot item's writes are.
    pub async fn write_fleet(
        &self,
        calls: &mut Calls,
        group: &str,
        read: &FleetItem,
        doc: &str,
        by: &str,
    ) -> Result<(), TableError> {
        if doc.len() > MAX_FLEET_DOC {
            return Err(TableError::Refused(CallError::terminal(
                "PutItem",
                format!(
                    "fleet document of {} bytes (at most {MAX_FLEET_DOC})",
                    doc.len()
                ),
            )));
        }
        let key = format!("{group}{FLEET_SUFFIX}");
        let item = HashMap::from([
            (attr::GROUP.to_string(), AttributeValue::S(key)),
            (
                attr::VERSION.to_string(),
                // `read.version` is below MAX_VERSION (`fencing_version`): it advances.
                AttributeValue::N((read.version + 1).to_string()),
            ),
            (attr::DOC.to_string(), AttributeValue::S(doc.to_string())),
            (
                attr::UPDATED_BY.to_string(),
                AttributeValue::S(by.to_string()),
            ),
        ]);
        let mut put = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(item));
        put = if read.exists {
            put.condition_expression("#v = :v")
                .expression_attribute_names("#v", attr::VERSION)
                .expression_attribute_values(":v", AttributeValue::N(read.version.to_string()))
        } else {
            put.condition_expression("attribute_not_exists(#g)")
                .expression_attribute_names("#g", attr::GROUP)
        };
        let r = put.send().await;
        calls
            .track("PutItem", r)
            .map(|_| ())
            .map_err(TableError::from_call)
    }
}

/// The whole item as PutItem writes it.
pub fn item_attributes(group: &str, item: &SlotItem) -> HashMap<String, AttributeValue> {
    let holders: HashMap<String, AttributeValue> = item
        .holders
        .iter()
        .map(|(id, h)| {
            let mut m = HashMap::from([
                (
                    attr::STATE.to_string(),
                    AttributeValue::S(h.state.as_str().to_string()),
                ),
                (
                    attr::TOKEN.to_string(),
                    AttributeValue::N(h.token.to_string()),
                ),
                (attr::SINCE.to_string(), AttributeValue::S(h.since.clone())),
            ]);
            if let Some(i) = &h.incident {
                m.insert(attr::INCIDENT.to_string(), AttributeValue::S(i.clone()));
            }
            (id.clone(), AttributeValue::M(m))
        })
        .collect();
    let mut out = HashMap::from([
        (
            attr::GROUP.to_string(),
            AttributeValue::S(group.to_string()),
        ),
        (
            attr::VERSION.to_string(),
            AttributeValue::N(item.version.to_string()),
        ),
        (attr::HOLDERS.to_string(), AttributeValue::M(holders)),
    ]);
    if let Some(b) = item.budget {
        out.insert(attr::BUDGET.to_string(), AttributeValue::N(b.to_string()));
    }
    if let Some(u) = &item.updated_by {
        out.insert(attr::UPDATED_BY.to_string(), AttributeValue::S(u.clone()));
    }
    if let Some(m) = item.members {
        out.insert(attr::MEMBERS.to_string(), AttributeValue::N(m.to_string()));
    }
    out
}

/// The largest version accepted from the table (the engine's counter ceiling, 2^62): one
/// beyond could not advance for long, and u64::MAX not at all.
pub const MAX_VERSION: u64 = 1 << 62;

/// An item's `version` (the slot item's and the fleet document's alike): a whole number
/// below [`MAX_VERSION`]. The fencing token is the version a write makes: one that cannot
/// advance would let every writer's conditional write "succeed" with the same token.
/// Refused, never saturated.
fn fencing_version(v: Option<&AttributeValue>) -> Result<u64, String> {
    let v = v.ok_or("no `version`")?;
    let version = v
        .as_n()
        .ok()
        .and_then(|n| n.parse::<u64>().ok())
        .ok_or_else(|| format!("version is not a whole number: {v:?}"))?;
    if version >= MAX_VERSION {
        return Err(format!(
            "version {version} cannot advance (at most {} is accepted)",
            MAX_VERSION - 1
        ));
    }
    Ok(version)
}

/// The item as GetItem returned it. Strict about what the protocol relies on (`version`, each
/// holder's `state` and `token`); lenient about what is for people only.
pub fn parse_item(
    group: &str,
    item: &HashMap<String, AttributeValue>,
) -> Result<SlotItem, TableError> {
    let bad = |why: String| TableError::Malformed {
        group: group.to_string(),
        why,
    };
    let number = |v: &AttributeValue, what: &str| -> Result<u64, TableError> {
        v.as_n()
            .ok()
            .and_then(|n| n.parse::<u64>().ok())
            .ok_or_else(|| bad(format!("{what} is not a whole number: {v:?}")))
    };
    let version = fencing_version(item.get(attr::VERSION)).map_err(bad)?;
    let mut holders = BTreeMap::new();
    if let Some(h) = item.get(attr::HOLDERS) {
        let map = h
            .as_m()
            .map_err(|_| bad(format!("`holders` is not a map: {h:?}")))?;
        for (id, e) in map {
            let e = e
                .as_m()
                .map_err(|_| bad(format!("holder {id} is not a map")))?;
            let state = match e
                .get(attr::STATE)
                .and_then(|s| s.as_s().ok())
                .map(String::as_str)
            {
                Some("reserved") => HolderState::Reserved,
                Some("committed") => HolderState::Committed,
                other => return Err(bad(format!("holder {id} has state {other:?}"))),
            };
            let token = e
                .get(attr::TOKEN)
                .ok_or_else(|| bad(format!("holder {id} has no token")))
                .and_then(|t| number(t, "token"))?;
            if token > version {
                return Err(bad(format!(
                    "holder {id} has token {token}, beyond the item's version {version}"
                )));
            }
            let text = |k: &str| e.get(k).and_then(|v| v.as_s().ok()).cloned();
            holders.insert(
                id.clone(),
                Holder {
                    state,
                    token,
                    incident: text(attr::INCIDENT),
                    since: text(attr::SINCE).unwrap_or_default(),
                },
            );
        }
    }
    Ok(SlotItem {
        version,
        exists: true,
        holders,
        budget: item
            .get(attr::BUDGET)
            .and_then(|b| b.as_n().ok())
            .and_then(|n| n.parse().ok()),
        updated_by: item
            .get(attr::UPDATED_BY)
            .and_then(|v| v.as_s().ok())
            .cloned(),
        members: item
            .get(attr::MEMBERS)
            .and_then(|b| b.as_n().ok())
            .and_then(|n| n.parse().ok()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SlotItem {
        SlotItem {
            version: 42,
            exists: true,
            holders: BTreeMap::from([
                (
                    "i-0abc".to_string(),
                    Holder {
                        state: HolderState::Committed,
                        token: 41,
                        incident: Some("7".into()),
                        since: "2026-11-30T10:00:00Z".into(),
                    },
                ),
                (
                    "i-0def".to_string(),
                    Holder {
                        state: HolderState::Reserved,
                        token: 42,
                        incident: None,
                        since: "2026-11-30T10:00:01Z".into(),
                    },
                ),
            ]),
            budget: Some(2),
            updated_by: Some("i-0def".into()),
            members: Some(10),
        }
    }

    #[test]
    fn an_item_reads_back_as_written() {
        let item = sample();
        let attrs = item_attributes("g", &item);
        assert_eq!(attrs[attr::GROUP], AttributeValue::S("g".into()));
        assert_eq!(parse_item("g", &attrs).unwrap(), item);
    }

    /// A version at u64::MAX (or any that could not advance), or a holder token beyond the
    /// version, is refused: no write is made with a token that cannot fence.
    #[test]
    fn a_version_that_cannot_advance_is_refused() {
        for v in [u64::MAX, u64::MAX - 1, MAX_VERSION] {
            let mut attrs = item_attributes("g", &sample());
            attrs.insert(attr::VERSION.into(), AttributeValue::N(v.to_string()));
            let e = parse_item("g", &attrs).unwrap_err();
            assert!(
                matches!(e, TableError::Malformed { .. }) && !e.is_retryable(),
                "{e}"
            );
            assert!(e.to_string().contains("cannot advance"), "{e}");
            // The fleet document's version is read by the same rule.
            let e = fencing_version(Some(&AttributeValue::N(v.to_string()))).unwrap_err();
            assert!(e.contains("cannot advance"), "{e}");
        }
        assert_eq!(
            fencing_version(Some(&AttributeValue::N((MAX_VERSION - 1).to_string()))),
            Ok(MAX_VERSION - 1)
        );
        let mut item = sample();
        item.version = 40;
        let e = parse_item("g", &item_attributes("g", &item)).unwrap_err();
        assert!(e.to_string().contains("beyond the item's version"), "{e}");
    }

    #[test]
    fn what_the_protocol_relies_on_must_be_readable() {
        let mut attrs = item_attributes("g", &sample());
        attrs.insert(attr::VERSION.into(), AttributeValue::S("x".into()));
        assert!(matches!(
            parse_item("g", &attrs),
            Err(TableError::Malformed { .. })
        ));
        attrs.remove(attr::VERSION);
        assert!(parse_item("g", &attrs).is_err());
        let mut attrs = item_attributes("g", &sample());
        attrs.insert(attr::HOLDERS.into(), AttributeValue::S("x".into()));
        assert!(parse_item("g", &attrs).is_err());
        let mut bad_state = item_attributes("g", &SlotItem::default());
        bad_state.insert(
            attr::HOLDERS.into(),
            AttributeValue::M(HashMap::from([(
                "i-1".to_string(),
                AttributeValue::M(HashMap::from([
                    ("state".to_string(), AttributeValue::S("leased".into())),
                    ("token".to_string(), AttributeValue::N("1".into())),
                ])),
            )])),
        );
        let e = parse_item("g", &bad_state).unwrap_err();
        assert!(e.to_string().contains("leased"), "{e}");
        assert!(!e.is_retryable());
    }

    #[test]
    fn errors_are_classified_by_code() {
        let with = |code: Option<&str>, retryable: bool| CallError {
            op: "PutItem",
            code: code.map(str::to_string),
            message: "m".into(),
            retryable,
            request_id: None,
        };
        assert_eq!(
            TableError::from_call(with(Some("ConditionalCheckFailedException"), false)),
            TableError::Conflict
        );
        for code in [
            "ProvisionedThroughputExceededException",
            "ThrottlingException",
            "RequestLimitExceeded",
        ] {
            let e = TableError::from_call(with(Some(code), false));
            assert!(matches!(e, TableError::Throttled(_)), "{code}");
            assert!(e.is_retryable());
        }
        assert!(matches!(
            TableError::from_call(with(None, true)),
            TableError::Unreachable(_)
        ));
        let missing = TableError::from_call(with(Some("ResourceNotFoundException"), false));
        assert!(matches!(missing, TableError::Refused(_)));
        assert!(!missing.is_retryable());
        assert!(matches!(
            TableError::from_call(with(Some("InternalServerError"), true)),
            TableError::Throttled(_)
        ));
    }
}
