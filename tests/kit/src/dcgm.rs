//! DCGM for the tests, where it cannot run (a GPU is needed): stand-in `dcgmi` scripts that
//! replay what dcgmi prints, and DCGM's own 4.x document schema read as a validator.
//!
//! - [`document`]: DCGM 4.x's `dcgmi diag -j` document for the fake libnvidia-ml's GPUs
//!   (shaped after DCGM's `dcgmi/Diag.cpp`; tests/fixtures/dcgm/README.md);
//! - [`replay`]: a stand-in that prints a file byte for byte (text before the JSON included)
//!   and exits with the code the capture had; [`no_host_engine`]: one that answers as dcgmi
//!   does when nv-hostengine is not running;
//! - [`Schema`]: `testing/python3/dcgm_diag_schema.json` from NVIDIA/DCGM (copied into
//!   tests/fixtures/dcgm), applied as it is written: `type`, `properties`, `items` and
//!   `required`, the only keywords it uses; a keyword it does not know is refused, never
//!   skipped, so the check cannot pass by ignoring the schema.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// The fixtures' folder.
pub fn fixtures() -> PathBuf {
    crate::repo().join("tests/fixtures/dcgm")
}

/// The document for GPUs `0..gpus`, each passing `software` and `memory`, except that the
/// memory test of `failing` fails with DCGM's kind of message (`DCGM_FR_MEMORY_MISMATCH`,
/// 58: severity `DCGM_ERROR_ISOLATE`, category `DCGM_FR_EC_HARDWARE_MEMORY`). As `dcgmi -j`
/// prints it: the document alone (dcgmi prints its "Successfully ran diagnostic" line only
/// without `-j`, `Diag::HelperDisplayAsCli`).
pub fn document(gpus: u32, failing: Option<u32>) -> String {
    let result = |gpu: u32, test: &str| {
        let fail = failing == Some(gpu) && test == "memory";
        let mut r = json!({
            "entity_group": "GPU", "entity_group_id": 1, "entity_id": gpu,
            "status": if fail { "Fail" } else { "Pass" },
        });
        if fail {
            r["warnings"] = json!([{
                "warning": format!("GPU {gpu}: memory miscompare at 0x1c0000400: expected 0xaaaaaaaa, found 0xaaaa2aaa"),
                "error_id": 58, "error_category": 10, "error_severity": 2,
            }]);
        }
        r
    };
    let test = |name: &str| {
        let results: Vec<Value> = (0..gpus).map(|g| result(g, name)).collect();
        let failed = results.iter().any(|r| r["status"] == "Fail");
        json!({"name": name, "results": results,
               "test_summary": {"status": if failed { "Fail" } else { "Pass" }}})
    };
    let doc = json!({
        "DCGM Diagnostic": {
            "test_categories": [
                {"category": "Deployment", "tests": [test("software")]},
                {"category": "Hardware", "tests": [test("memory")]},
            ],
        },
        "entity_groups": [{"entity_group": "GPU", "entity_group_id": 1,
            "entities": (0..gpus).map(|g| json!({"entity_id": g, "serial_num": format!("16549220023{g}"), "device_id": "2335"})).collect::<Vec<_>>()}],
        "metadata": {"version": "4.2.3", "Driver Version Detected": "570.172.08"},
    });
    format!("{doc}\n")
}

/// Writes an executable `sh` script at `path`: its arguments appended to `calls`, then `body`.
fn script(path: &Path, calls: &Path, body: &str) -> PathBuf {
    let text = format!(
        "#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{}'\n{body}\n",
        calls.display()
    );
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_path_buf()
}

/// A stand-in `dcgmi` in `dir` that prints `file` byte for byte and exits with `exit`; its
/// arguments go to `dir/calls`.
pub fn replay(dir: &Path, file: &Path, exit: i32) -> PathBuf {
    script(
        &dir.join("dcgmi"),
        &dir.join("calls"),
        &format!("cat '{}'\nexit {exit}", file.display()),
    )
}

/// A stand-in `dcgmi` in `dir` answering as dcgmi does when no host engine answers at
/// `--host` (dcgmi/Command.cpp: "Error: Unable to connect to host engine. " and
/// `errorString(DCGM_ST_CONNECTION_NOT_VALID)`, exit -21 as 235); its arguments go to
/// `dir/calls`.
pub fn no_host_engine(dir: &Path) -> PathBuf {
    script(
        &dir.join("dcgmi"),
        &dir.join("calls"),
        "echo 'Error: Unable to connect to host engine. Host engine connection invalid/disconnected.'\nexit 235",
    )
}

/// The arguments each call of a stand-in in `dir` had, oldest first.
pub fn calls(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("calls"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// DCGM's JSON schema of the 4.x diag document.
pub struct Schema(Value);

impl Schema {
    /// `tests/fixtures/dcgm/dcgm_diag_schema.json`.
    pub fn dcgm_diag() -> Schema {
        let path = fixtures().join("dcgm_diag_schema.json");
        let text = std::fs::read_to_string(&path).unwrap();
        Schema(serde_json::from_str(&text).unwrap())
    }

    /// Every place `doc` breaks the schema, each as `/json/pointer: what`; empty when it
    /// follows it. Panics on a keyword the validator does not apply.
    pub fn violations(&self, doc: &Value) -> Vec<String> {
        let mut out = Vec::new();
        check(&self.0, doc, "", &mut out);
        out
    }
}

/// The keywords applied; `$schema` is the schema's own declaration.
const KEYWORDS: [&str; 5] = ["type", "properties", "items", "required", "$schema"];

fn check(schema: &Value, v: &Value, at: &str, out: &mut Vec<String>) {
    let Some(s) = schema.as_object() else {
        panic!("the schema at {at:?} is not an object: {schema}");
    };
    for key in s.keys() {
        assert!(
            KEYWORDS.contains(&key.as_str()),
            "the schema uses {key:?} at {at:?}, which this validator does not apply"
        );
    }
    if let Some(t) = s.get("type").and_then(Value::as_str) {
        let ok = match t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            "integer" => v.is_i64() || v.is_u64(),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            other => panic!("type {other:?} at {at:?} is not applied"),
        };
        if !ok {
            out.push(format!(
                "{}: expected {t}, found {v}",
                if at.is_empty() { "/" } else { at }
            ));
            return;
        }
    }
    if let (Some(req), Some(o)) = (s.get("required").and_then(Value::as_array), v.as_object()) {
        for k in req.iter().filter_map(Value::as_str) {
            if !o.contains_key(k) {
                out.push(format!("{at}/{}: required, missing", escape(k)));
            }
        }
    }
    if let (Some(props), Some(o)) = (
        s.get("properties").and_then(Value::as_object),
        v.as_object(),
    ) {
        for (k, sub) in props {
            if let Some(x) = o.get(k) {
                check(sub, x, &format!("{at}/{}", escape(k)), out);
            }
        }
    }
    if let (Some(items), Some(a)) = (s.get("items"), v.as_array()) {
        for (i, x) in a.iter().enumerate() {
            check(items, x, &format!("{at}/{i}"), out);
        }
    }
}

/// A key as a JSON pointer writes it (RFC 6901).
fn escape(k: &str) -> String {
    k.replace('~', "~0").replace('/', "~1")
}
