//! What a stand-in `dcgmi` prints: DCGM 4.x's `dcgmi diag -j` document (shaped after DCGM's
//! `dcgmi/Diag.cpp`; tests/fixtures/dcgm/README.md), for the tests that need DCGM's answer for
//! the fake libnvidia-ml's GPUs. A test double for what cannot run here: DCGM on a GPU.

use serde_json::{Value, json};

/// The document for GPUs `0..gpus`, each passing `software` and `memory`, except that the
/// memory test of `failing` fails with DCGM's kind of message. Preceded by the line of text
/// dcgmi prints before its JSON.
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
                "error_id": 83, "error_category": 4, "error_severity": 3,
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
    format!("Successfully ran diagnostic for group.\n{doc}\n")
}
