//! The one EC2 fact the fleet budget's slot table needs: which instances are terminated;
//! the one EC2 action the reboot rung takes: `RebootInstances` on this instance; and the tag
//! that keeps this instance's reboots beyond its disk (`CreateTags` on itself, one key;
//! `DescribeTags` to read it back at start).
//!
//! `DescribeInstances` by id: state `terminated`, or the id unknown to EC2
//! (`InvalidInstanceID.NotFound`: a terminated instance stays visible for about an hour, then
//! is gone). Both never revert, and both hold only once the instance, and the gpu-medic on
//! it, can no longer act; `shutting-down` and `stopped` are not enough (a stopped instance
//! starts again with its gpu-medic). Absence from the Auto Scaling group's list is not this
//! fact either (a detached instance still runs).

use std::collections::BTreeSet;

use aws_config::SdkConfig;
use aws_smithy_xml::decode::{Document, ScopedDecoder, XmlDecodeError, try_data};

use super::calls::{CallError, Calls};
use super::signed::{Reply, Service, ServiceError, SignedClient};

/// EC2 through the Query API ([`super::signed`]): two calls do not justify `aws-sdk-ec2`.
#[derive(Debug, Clone)]
pub struct Ec2 {
    client: SignedClient,
}

const NOT_FOUND: &str = "InvalidInstanceID.NotFound";
const SERVICE: Service = Service {
    id: "EC2",
    signing_name: "ec2",
};
/// The EC2 API version every Query request names.
const VERSION: &str = "2016-11-15";

impl Ec2 {
    pub fn new(sdk: &SdkConfig) -> Self {
        Ec2 {
            client: SignedClient::new(sdk, SERVICE),
        }
    }

    /// Which of `ids` are terminated (or unknown to EC2). One call for all of them; when one
    /// id is unknown EC2 fails the whole call, so each id is then asked alone.
    pub async fn terminated(
        &self,
        calls: &mut Calls,
        ids: &[String],
    ) -> Result<BTreeSet<String>, CallError> {
        if ids.is_empty() {
            return Ok(BTreeSet::new());
        }
        match self.describe(calls, ids).await {
            Err(e) if e.code.as_deref() == Some(NOT_FOUND) => {
                let mut out = BTreeSet::new();
                for id in ids {
                    match self.describe(calls, std::slice::from_ref(id)).await {
                        Ok(t) => out.extend(t),
                        Err(e) if e.code.as_deref() == Some(NOT_FOUND) => {
                            out.insert(id.clone());
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok(out)
            }
            other => other,
        }
    }

    /// Asks EC2 to reboot `id` (the reboot rung reboots only its own instance). EC2 waits
    /// for the OS to shut down and hard-reboots it after about four minutes; the call returns
    /// at once. moto answers it without a state change.
    pub async fn reboot(&self, calls: &mut Calls, id: &str) -> Result<(), CallError> {
        let form = form("RebootInstances", &[("InstanceId.1".to_string(), id)]);
        let r = self.call(calls, "RebootInstances", &form).await?;
        if parse_return(&r.body) == Some(false) {
            return Err(CallError::terminal(
                "RebootInstances",
                "EC2 answered return=false",
            ));
        }
        Ok(())
    }

    /// Sets tag `key` = `value` on instance `id` (IAM lets an instance tag only itself, and
    /// only with gpu-medic's key: packaging/iam-policy.json).
    pub async fn tag(
        &self,
        calls: &mut Calls,
        id: &str,
        key: &str,
        value: &str,
    ) -> Result<(), CallError> {
        let params = [
            ("ResourceId.1".to_string(), id),
            ("Tag.1.Key".to_string(), key),
            ("Tag.1.Value".to_string(), value),
        ];
        let r = self
            .call(calls, "CreateTags", &form("CreateTags", &params))
            .await?;
        if parse_return(&r.body) == Some(false) {
            return Err(CallError::terminal(
                "CreateTags",
                "EC2 answered return=false",
            ));
        }
        Ok(())
    }

    /// The value of tag `key` on instance `id`; `None` when it has no such tag.
    pub async fn tag_value(
        &self,
        calls: &mut Calls,
        id: &str,
        key: &str,
    ) -> Result<Option<String>, CallError> {
        let params = [
            ("Filter.1.Name".to_string(), "resource-id"),
            ("Filter.1.Value.1".to_string(), id),
            ("Filter.2.Name".to_string(), "key"),
            ("Filter.2.Value.1".to_string(), key),
        ];
        let r = self
            .call(calls, "DescribeTags", &form("DescribeTags", &params))
            .await?;
        parse_tag(&r.body, id, key).map_err(|e| {
            CallError::terminal(
                "DescribeTags",
                format!("unreadable response (HTTP {}): {e}", r.status),
            )
        })
    }

    async fn describe(
        &self,
        calls: &mut Calls,
        ids: &[String],
    ) -> Result<BTreeSet<String>, CallError> {
        let params: Vec<(String, &str)> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (format!("InstanceId.{}", i + 1), id.as_str()))
            .collect();
        let r = self
            .call(
                calls,
                "DescribeInstances",
                &form("DescribeInstances", &params),
            )
            .await?;
        parse_terminated(&r.body).map_err(|e| {
            CallError::terminal(
                "DescribeInstances",
                format!("unreadable response (HTTP {}): {e}", r.status),
            )
        })
    }

    async fn call(
        &self,
        calls: &mut Calls,
        op: &'static str,
        form: &str,
    ) -> Result<Reply, CallError> {
        let r = self
            .client
            .post_form(op, form, parse_error)
            .await
            .map(|mut r| {
                r.request_id = r.request_id.take().or_else(|| request_id(&r.body));
                r
            });
        calls.track_signed(op, r, |r| r.request_id.as_deref())
    }
}

/// `Action=..&Version=..&k=v..`, each value percent-encoded (RFC 3986 unreserved kept).
fn form(action: &str, params: &[(String, &str)]) -> String {
    let mut out = format!("Action={action}&Version={VERSION}");
    for (k, v) in params {
        out.push('&');
        out.push_str(k);
        out.push('=');
        for b in v.bytes() {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                out.push(char::from(b));
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
    }
    out
}

/// The ids of the terminated instances in a `DescribeInstancesResponse`
/// (`reservationSet/item/instancesSet/item/{instanceId, instanceState/name}`).
fn parse_terminated(xml: &str) -> Result<BTreeSet<String>, XmlDecodeError> {
    let mut doc = Document::new(xml);
    let mut root = doc.root_element()?;
    let mut out = BTreeSet::new();
    while let Some(mut set) = root.next_tag() {
        if !set.start_el().local().eq("reservationSet") {
            continue;
        }
        while let Some(mut reservation) = set.next_tag() {
            while let Some(mut instances) = reservation.next_tag() {
                if !instances.start_el().local().eq("instancesSet") {
                    continue;
                }
                while let Some(mut item) = instances.next_tag() {
                    let (id, state) = instance(&mut item)?;
                    if let (Some(id), Some("terminated")) = (id, state.as_deref()) {
                        out.insert(id);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The value of tag `key` of resource `id` in a `DescribeTagsResponse`
/// (`tagSet/item/{resourceId, key, value}`); `None` when it lists none.
fn parse_tag(xml: &str, id: &str, key: &str) -> Result<Option<String>, XmlDecodeError> {
    let mut doc = Document::new(xml);
    let mut root = doc.root_element()?;
    while let Some(mut set) = root.next_tag() {
        if !set.start_el().local().eq("tagSet") {
            continue;
        }
        while let Some(mut item) = set.next_tag() {
            let (mut rid, mut k, mut v) = (None, None, None);
            while let Some(mut field) = item.next_tag() {
                let name = field.start_el().local().to_string();
                let text = try_data(&mut field)?.into_owned();
                match name.as_str() {
                    "resourceId" => rid = Some(text),
                    "key" => k = Some(text),
                    "value" => v = Some(text),
                    _ => {}
                }
            }
            if rid.as_deref() == Some(id) && k.as_deref() == Some(key) {
                return Ok(Some(v.unwrap_or_default()));
            }
        }
    }
    Ok(None)
}

/// One instance's id and state name.
fn instance(
    item: &mut ScopedDecoder<'_, '_>,
) -> Result<(Option<String>, Option<String>), XmlDecodeError> {
    let (mut id, mut state) = (None, None);
    while let Some(mut field) = item.next_tag() {
        match field.start_el().local() {
            "instanceId" => id = Some(try_data(&mut field)?.into_owned()),
            "instanceState" => {
                while let Some(mut s) = field.next_tag() {
                    if s.start_el().local() == "name" {
                        state = Some(try_data(&mut s)?.into_owned());
                    }
                }
            }
            _ => {}
        }
    }
    Ok((id, state))
}

/// `<return>` of an action's response, when it says.
fn parse_return(xml: &str) -> Option<bool> {
    top_level(xml, "return").map(|v| v == "true")
}

/// A success's `<requestId>`.
fn request_id(xml: &str) -> Option<String> {
    top_level(xml, "requestId")
}

/// The text of the root's child `name`.
fn top_level(xml: &str, name: &str) -> Option<String> {
    let mut doc = Document::new(xml);
    let mut root = doc.root_element().ok()?;
    while let Some(mut tag) = root.next_tag() {
        if tag.start_el().local() == name {
            return try_data(&mut tag).ok().map(|v| v.trim().to_string());
        }
    }
    None
}

/// EC2's refusal: `<Response><Errors><Error><Code/><Message/></Error></Errors><RequestID/>`.
fn parse_error(xml: &str) -> ServiceError {
    let mut out = ServiceError::default();
    let mut doc = Document::new(xml);
    let Ok(mut root) = doc.root_element() else {
        return out;
    };
    while let Some(mut tag) = root.next_tag() {
        match tag.start_el().local() {
            "Errors" => {
                let Some(mut error) = tag.next_tag() else {
                    continue;
                };
                while let Some(mut f) = error.next_tag() {
                    let field = f.start_el().local().to_string();
                    let text = try_data(&mut f).ok().map(|v| v.into_owned());
                    match field.as_str() {
                        "Code" => out.code = text,
                        "Message" => out.message = text,
                        _ => {}
                    }
                }
            }
            "RequestID" | "RequestId" | "requestId" => {
                out.request_id = try_data(&mut tag).ok().map(|v| v.into_owned());
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const DESCRIBED: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
  <requestId>r-1</requestId>
  <reservationSet>
    <item>
      <reservationId>r-0a</reservationId>
      <groupSet><item><groupId>sg-1</groupId></item></groupSet>
      <instancesSet>
        <item>
          <instanceId>i-gone</instanceId>
          <instanceState><code>48</code><name>terminated</name></instanceState>
          <tagSet><item><key>instanceId</key><value>i-decoy</value></item></tagSet>
        </item>
        <item>
          <instanceId>i-running</instanceId>
          <instanceState><code>16</code><name>running</name></instanceState>
        </item>
      </instancesSet>
    </item>
    <item>
      <instancesSet>
        <item>
          <instanceState><name>terminated</name></instanceState>
          <instanceId>i-also-gone</instanceId>
        </item>
        <item>
          <instanceId>i-stopping</instanceId>
          <instanceState><name>shutting-down</name></instanceState>
        </item>
      </instancesSet>
    </item>
  </reservationSet>
</DescribeInstancesResponse>"#;

    #[test]
    fn only_terminated_instances_are_read_and_nested_items_are_not_instances() {
        let got = parse_terminated(DESCRIBED).unwrap();
        assert_eq!(
            got.into_iter().collect::<Vec<_>>(),
            ["i-also-gone", "i-gone"]
        );
        assert_eq!(request_id(DESCRIBED).as_deref(), Some("r-1"));
        assert!(
            parse_terminated("not xml <").is_err()
                || parse_terminated("not xml <").unwrap().is_empty()
        );
        assert!(
            parse_terminated("<DescribeInstancesResponse/>")
                .unwrap()
                .is_empty()
        );
    }

    /// Only the tag of this instance with this key is read (a filter EC2 ignored does not
    /// hand over another's).
    #[test]
    fn the_tag_read_is_this_instances_key_only() {
        let xml = r#"<DescribeTagsResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
  <requestId>r</requestId>
  <tagSet>
    <item><resourceId>i-other</resourceId><resourceType>instance</resourceType><key>gpu-medic:reboots</key><value>9/9/x</value></item>
    <item><resourceId>i-me</resourceId><resourceType>instance</resourceType><key>Name</key><value>n</value></item>
    <item><resourceId>i-me</resourceId><resourceType>instance</resourceType><key>gpu-medic:reboots</key><value>1/2/r</value></item>
  </tagSet>
</DescribeTagsResponse>"#;
        assert_eq!(
            parse_tag(xml, "i-me", "gpu-medic:reboots")
                .unwrap()
                .as_deref(),
            Some("1/2/r")
        );
        assert_eq!(parse_tag(xml, "i-none", "gpu-medic:reboots").unwrap(), None);
        assert_eq!(
            parse_tag(
                "<DescribeTagsResponse><tagSet/></DescribeTagsResponse>",
                "i-me",
                "k"
            )
            .unwrap(),
            None
        );
    }

    #[test]
    fn an_error_names_its_code_message_and_request() {
        let e = parse_error(
            r#"<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>InvalidInstanceID.NotFound</Code><Message>The instance ID 'i-x' does not exist</Message></Error></Errors><RequestID>req-9</RequestID></Response>"#,
        );
        assert_eq!(e.code.as_deref(), Some(NOT_FOUND));
        assert_eq!(
            e.message.as_deref(),
            Some("The instance ID 'i-x' does not exist")
        );
        assert_eq!(e.request_id.as_deref(), Some("req-9"));
        assert_eq!(
            parse_error("<html>502 Bad Gateway</html>"),
            ServiceError::default()
        );
        assert_eq!(parse_error(""), ServiceError::default());
    }

    #[test]
    fn the_form_encodes_every_value() {
        assert_eq!(
            form(
                "DescribeInstances",
                &[
                    ("InstanceId.1".to_string(), "i-0abc"),
                    ("InstanceId.2".to_string(), "a&b=c d/é")
                ]
            ),
            "Action=DescribeInstances&Version=2016-11-15&InstanceId.1=i-0abc&InstanceId.2=a%26b%3Dc%20d%2F%C3%A9"
        );
        assert_eq!(
            parse_return(
                "<RebootInstancesResponse><requestId>x</requestId><return>true</return></RebootInstancesResponse>"
            ),
            Some(true)
        );
    }
}
