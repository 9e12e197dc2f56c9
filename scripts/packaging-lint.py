#!/usr/bin/env python3
"""Checks the packaging artefacts against each other and against packaging/config.toml.

    python3 scripts/packaging-lint.py [--require-hcl]
    python3 scripts/packaging-lint.py --cfn-json   print the CloudFormation example as JSON
                                                   (tests/dashboards.rs reads its metrics)

Syntax: packaging/iam-policy.json, packaging/examples/cloudwatch-agent.json (JSON),
packaging/imagebuilder-component.yaml, packaging/examples/cloudformation.yaml (YAML, with
CloudFormation's short tags), packaging/packer-provisioner.pkr.hcl (HCL, when python-hcl2 is
importable). Consistency: the unit's paths and the config's state_dir, the IAM policy in the
template against iam-policy.json, every statement's reason in packaging/README.md, the hook
names and attribute prefix against the config, the CloudWatch file path against state_dir.
cfn-lint (the template against AWS's schemas) is run by scripts/packaging-check.sh.
Needs PyYAML (Debian: python3-yaml) and Python >= 3.11 (tomllib).
"""

import json
import re
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "packaging"
errors: list[str] = []


def check(cond: bool, msg: str) -> None:
    if not cond:
        errors.append(msg)


class CfnLoader(yaml.SafeLoader):
    """Reads CloudFormation's short-form tags (!Ref, !Sub, !GetAtt, ...) as plain data."""


def _cfn_tag(loader, tag_suffix, node):
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    name = "Ref" if tag_suffix == "Ref" else f"Fn::{tag_suffix}"
    return {name: value}


CfnLoader.add_multi_constructor("!", _cfn_tag)


def unit_settings(path: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def as_list(v) -> list:
    return v if isinstance(v, list) else [v]


def main() -> int:
    if "--cfn-json" in sys.argv[1:]:
        with open(PKG / "examples" / "cloudformation.yaml") as f:
            print(json.dumps(yaml.load(f, Loader=CfnLoader)))
        return 0
    require_hcl = "--require-hcl" in sys.argv[1:]
    config = tomllib.loads((PKG / "config.toml").read_text())
    state_dir = config.get("state_dir", "/var/lib/gpu-medic")
    prefix = config.get("ecs", {}).get("attribute_prefix", "gpu-medic")
    lifecycle = config.get("lifecycle", {})
    launch_hook = lifecycle.get("launch_hook", "gpu-medic-launch")
    terminate_hook = lifecycle.get("terminate_hook", "gpu-medic-terminate")
    pause_tag = config.get("fleet", {}).get("pause_tag", "gpu-medic/paused")

    # --- The unit ------------------------------------------------------------------------
    unit = unit_settings(PKG / "gpu-medic.service")
    check(unit.get("Type") == ["notify"], "unit: Type=notify")
    check(unit.get("NotifyAccess") == ["main"], "unit: NotifyAccess=main")
    check("WatchdogSec" in unit, "unit: WatchdogSec")
    check(unit.get("Restart") == ["always"], "unit: Restart=always")
    check(
        unit.get("ExecStart") == ["/usr/bin/gpu-medic run --config /etc/gpu-medic/config.toml"],
        "unit: ExecStart=/usr/bin/gpu-medic run --config /etc/gpu-medic/config.toml",
    )
    check(
        unit.get("StateDirectory") == [Path(state_dir).name] and Path(state_dir).parent == Path("/var/lib"),
        f"unit: StateDirectory= must match config.toml state_dir ({state_dir})",
    )
    check("ecs.service" in " ".join(unit.get("Before", [])), "unit: Before=ecs.service")
    for dep in ("Requires", "BindsTo", "Requisite", "PartOf"):
        check(dep not in unit, f"unit: no {dep}= (gpu-medic must outlive the units it watches)")
    check(unit.get("PrivateDevices", ["no"]) == ["no"], "unit: PrivateDevices=yes hides /dev/nvidia*")
    check(unit.get("ProtectKernelLogs", ["no"]) == ["no"], "unit: ProtectKernelLogs=yes hides /dev/kmsg")
    check(unit.get("PrivateUsers", ["no"]) == ["no"], "unit: PrivateUsers=yes breaks systemctl restart over D-Bus")
    check(
        "CAP_SYSLOG" in " ".join(unit.get("CapabilityBoundingSet", ["CAP_SYSLOG"])),
        "unit: CAP_SYSLOG is needed for /dev/kmsg",
    )

    # --- IAM policy ------------------------------------------------------------------------
    policy = json.loads((PKG / "iam-policy.json").read_text())
    check(policy.get("Version") == "2012-10-17", "iam-policy.json: Version 2012-10-17")
    statements = policy.get("Statement", [])
    sids = [s.get("Sid") for s in statements]
    check(all(sids) and len(set(sids)) == len(sids), "iam-policy.json: every statement has a unique Sid")
    readme = (PKG / "README.md").read_text()
    for s in statements:
        sid = s.get("Sid", "?")
        check(s.get("Effect") in ("Allow", "Deny"), f"iam-policy.json {sid}: Effect")
        for action in as_list(s.get("Action", [])):
            check(
                re.fullmatch(r"(ecs|autoscaling|logs|events|dynamodb|ec2|s3|kms):[A-Za-z]+", action) is not None,
                f"iam-policy.json {sid}: {action!r} is not one named ECS, Auto Scaling, CloudWatch Logs, EventBridge, DynamoDB, EC2, S3 or KMS action",
            )
        check("Resource" in s, f"iam-policy.json {sid}: Resource")
        if s.get("Effect") == "Allow" and any(
            a.split(":")[1].startswith(("Put", "Delete", "Update", "Stop", "Set", "Complete", "Record", "Terminate", "Create"))
            for a in as_list(s.get("Action", []))
        ):
            check(
                "Condition" in s or s.get("Resource") != "*",
                f"iam-policy.json {sid}: a write action must be scoped (Resource or Condition)",
            )
        check(f"`{sid}`" in readme, f"packaging/README.md: no reason given for statement `{sid}`")
    text = json.dumps(policy)
    check(pause_tag in text, f"iam-policy.json: the kill switch tag {pause_tag} must be protected")

    # --- CloudFormation example --------------------------------------------------------------
    cfn = yaml.load((PKG / "examples" / "cloudformation.yaml").read_text(), Loader=CfnLoader)
    res = cfn.get("Resources", {})
    by_type: dict[str, list[dict]] = {}
    for r in res.values():
        by_type.setdefault(r.get("Type"), []).append(r.get("Properties", {}))
    for t in (
        "AWS::ECS::Cluster",
        "AWS::AutoScaling::AutoScalingGroup",
        "AWS::ECS::CapacityProvider",
        "AWS::ECS::ClusterCapacityProviderAssociations",
        "AWS::ECS::TaskDefinition",
        "AWS::IAM::Role",
    ):
        check(t in by_type, f"cloudformation.yaml: a {t}")
    for asg in by_type.get("AWS::AutoScaling::AutoScalingGroup", []):
        hooks = {h["LifecycleHookName"]: h for h in asg.get("LifecycleHookSpecificationList", [])}
        check(
            hooks.get(launch_hook, {}).get("LifecycleTransition") == "autoscaling:EC2_INSTANCE_LAUNCHING",
            f"cloudformation.yaml: hook {launch_hook} on EC2_INSTANCE_LAUNCHING",
        )
        check(
            hooks.get(terminate_hook, {}).get("LifecycleTransition") == "autoscaling:EC2_INSTANCE_TERMINATING",
            f"cloudformation.yaml: hook {terminate_hook} on EC2_INSTANCE_TERMINATING",
        )
        check(
            hooks.get(terminate_hook, {}).get("DefaultResult") == "CONTINUE",
            f"cloudformation.yaml: {terminate_hook} DefaultResult CONTINUE (ABANDON skips ECS's own hook)",
        )
        check(
            asg.get("InstanceMaintenancePolicy", {}).get("MinHealthyPercentage") == 100,
            "cloudformation.yaml: InstanceMaintenancePolicy MinHealthyPercentage 100",
        )
        tags = {t["Key"]: t for t in asg.get("Tags", [])}
        check(
            tags.get("gpu-medic/managed", {}).get("Value") == "true"
            and tags["gpu-medic/managed"].get("PropagateAtLaunch") is False,
            "cloudformation.yaml: the group carries gpu-medic/managed=true (not propagated)",
        )
    for td in by_type.get("AWS::ECS::TaskDefinition", []):
        exprs = [c.get("Expression") for c in td.get("PlacementConstraints", []) if c.get("Type") == "memberOf"]
        check(
            f"attribute:{prefix}.health == ok" in exprs,
            f"cloudformation.yaml: placement constraint attribute:{prefix}.health == ok",
        )
        mps = [
            rr
            for c in td.get("ContainerDefinitions", [])
            for rr in c.get("ResourceRequirements", [])
            if rr.get("Type") == "GPU" and "NvidiaMps" in rr.get("SharingStrategy", {})
        ]
        check(bool(mps), "cloudformation.yaml: a GPU requirement with SharingStrategy.NvidiaMps")
    # The inline policy says what iam-policy.json says.
    inline = [
        p["PolicyDocument"]
        for role in by_type.get("AWS::IAM::Role", [])
        for p in role.get("Policies", [])
        if p.get("PolicyName") == "gpu-medic"
    ]
    check(len(inline) == 1, "cloudformation.yaml: the role has the inline policy gpu-medic")
    if inline:
        def shape(statements):
            return {
                s["Sid"]: (
                    s["Effect"],
                    tuple(sorted(as_list(s["Action"]))),
                    json.dumps(
                        {op: sorted(v) for op, v in s.get("Condition", {}).items()}, sort_keys=True
                    ),
                )
                for s in statements
            }

        a, b = shape(statements), shape(inline[0]["Statement"])
        for sid in sorted(set(a) | set(b)):
            check(a.get(sid) == b.get(sid), f"cloudformation.yaml: statement {sid} differs from iam-policy.json")

    # The export: a log group named as gpu-medic's default, and a rule for fatal incidents.
    check(
        any("/gpu-medic/${ClusterName}" in json.dumps(g.get("LogGroupName")) for g in by_type.get("AWS::Logs::LogGroup", [])),
        "cloudformation.yaml: the incident log group /gpu-medic/${ClusterName}",
    )
    rules = by_type.get("AWS::Events::Rule", [])
    check(
        any(r.get("EventPattern", {}).get("source") == ["gpu-medic"] for r in rules),
        "cloudformation.yaml: an EventBridge rule on source gpu-medic",
    )
    check("AWS::SNS::Topic" in by_type, "cloudformation.yaml: an SNS topic for on-call")

    # The fleet budget's table: the key the slot protocol writes, billed on demand, and the
    # only item actions the protocol uses (models/README.md, "Slot protocol").
    tables = by_type.get("AWS::DynamoDB::Table", [])
    check(len(tables) == 1, "cloudformation.yaml: one DynamoDB table for the fleet budget")
    for t in tables:
        check(t.get("BillingMode") == "PAY_PER_REQUEST", "cloudformation.yaml: the fleet table bills on demand")
        check(
            t.get("KeySchema") == [{"AttributeName": "group", "KeyType": "HASH"}],
            "cloudformation.yaml: the fleet table's key is `group` (HASH) only",
        )
    # The reboot rung: the instance may reboot only itself (docs/repair.md).
    reboots = [s for s in statements if "ec2:RebootInstances" in as_list(s.get("Action", []))]
    check(len(reboots) == 1, "iam-policy.json: one statement allows ec2:RebootInstances")
    for s in reboots:
        cond = s.get("Condition", {}).get("ArnEquals", {})
        check(
            s.get("Effect") == "Allow"
            and as_list(s.get("Action")) == ["ec2:RebootInstances"]
            and ":instance/" in json.dumps(s.get("Resource"))
            and cond.get("ec2:SourceInstanceARN", "").endswith(":instance/${ec2:InstanceID}"),
            "iam-policy.json: ec2:RebootInstances only with ArnEquals ec2:SourceInstanceARN = "
            "the target's ARN (.../instance/${ec2:InstanceID}): an instance reboots only itself",
        )
    # The reboot count's tag: the instance tags only itself, and only with gpu-medic's key.
    tags = [s for s in statements if "ec2:CreateTags" in as_list(s.get("Action", []))]
    check(len(tags) == 1, "iam-policy.json: one statement allows ec2:CreateTags")
    for s in tags:
        cond = s.get("Condition", {})
        check(
            as_list(s.get("Action")) == ["ec2:CreateTags"]
            and cond.get("ArnEquals", {}).get("ec2:SourceInstanceARN", "").endswith(":instance/${ec2:InstanceID}")
            and as_list(cond.get("ForAllValues:StringEquals", {}).get("aws:TagKeys")) == ["gpu-medic:reboots"],
            "iam-policy.json: ec2:CreateTags only on the instance itself and only the key gpu-medic:reboots",
        )
    dyn = sorted(a for s in statements for a in as_list(s.get("Action", [])) if a.startswith("dynamodb:"))
    check(dyn == ["dynamodb:GetItem", "dynamodb:PutItem"], f"iam-policy.json: DynamoDB actions are GetItem and PutItem only, not {dyn}")
    check(
        all(":table/" in json.dumps(s.get("Resource")) for s in statements if any(a.startswith("dynamodb:") for a in as_list(s.get("Action", [])))),
        "iam-policy.json: DynamoDB actions are scoped to the table's ARN",
    )

    # The evidence bucket (docs/evidence.md): S3 writes on the evidence prefix only, KMS on
    # one key only, and a bucket that is encrypted, never public and expires what it holds.
    s3_actions = sorted(a for s in statements for a in as_list(s.get("Action", [])) if a.startswith("s3:"))
    check(
        s3_actions == ["s3:AbortMultipartUpload", "s3:ListMultipartUploadParts", "s3:PutObject"],
        f"iam-policy.json: S3 actions are PutObject and the multipart ones only, not {s3_actions}",
    )
    for s in statements:
        acts = as_list(s.get("Action", []))
        if any(a.startswith("s3:") for a in acts):
            for r in as_list(s.get("Resource")):
                check(
                    r.startswith("arn:aws:s3:::") and r.count("/") >= 2 and "/gpu-medic/evidence/" in r and r.endswith("/*"),
                    f"iam-policy.json {s.get('Sid')}: S3 access is on the evidence prefix only, not {r}",
                )
        if any(a.startswith("kms:") for a in acts):
            check(
                sorted(acts) == ["kms:Decrypt", "kms:GenerateDataKey"],
                f"iam-policy.json {s.get('Sid')}: KMS actions are GenerateDataKey (and Decrypt, for multipart) only",
            )
            check(
                all(":key/" in r for r in as_list(s.get("Resource"))),
                f"iam-policy.json {s.get('Sid')}: KMS access is on the configured key only",
            )
            check(
                "kms:ViaService" in json.dumps(s.get("Condition", {})),
                f"iam-policy.json {s.get('Sid')}: the key is used through S3 only (kms:ViaService)",
            )
    buckets = by_type.get("AWS::S3::Bucket", [])
    check(len(buckets) == 1, "cloudformation.yaml: one S3 bucket for evidence")
    for bk in buckets:
        enc = bk.get("BucketEncryption", {}).get("ServerSideEncryptionConfiguration", [])
        check(
            any(e.get("ServerSideEncryptionByDefault", {}).get("SSEAlgorithm") in ("aws:kms", "AES256") for e in enc),
            "cloudformation.yaml: the evidence bucket is encrypted by default",
        )
        pab = bk.get("PublicAccessBlockConfiguration", {})
        check(
            all(pab.get(k) is True for k in ("BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets")),
            "cloudformation.yaml: the evidence bucket blocks all public access",
        )
        rules = bk.get("LifecycleConfiguration", {}).get("Rules", [])
        check(
            any(r.get("Status") == "Enabled" and r.get("ExpirationInDays") for r in rules),
            "cloudformation.yaml: the evidence bucket has a lifecycle rule that expires archives",
        )

    # --- CloudWatch agent ----------------------------------------------------------------------
    cw = json.loads((PKG / "examples" / "cloudwatch-agent.json").read_text())
    files = cw.get("logs", {}).get("logs_collected", {}).get("files", {}).get("collect_list", [])
    check(
        any(f.get("file_path") == f"{state_dir}/incidents.jsonl" for f in files),
        f"cloudwatch-agent.json: collects {state_dir}/incidents.jsonl",
    )

    # --- Image Builder component -------------------------------------------------------------
    ib = yaml.safe_load((PKG / "imagebuilder-component.yaml").read_text())
    check(ib.get("schemaVersion") == 1.0, "imagebuilder-component.yaml: schemaVersion 1.0")
    check(bool(ib.get("name")), "imagebuilder-component.yaml: name")
    phases = {p["name"]: p for p in ib.get("phases", [])}
    check({"build", "validate"} <= set(phases), "imagebuilder-component.yaml: build and validate phases")
    for p in phases.values():
        for step in p.get("steps", []):
            check(
                step.get("action") in ("S3Download", "ExecuteBash", "WebDownload", "Reboot"),
                f"imagebuilder-component.yaml: step {step.get('name')}: unexpected action {step.get('action')}",
            )
    commands = json.dumps(ib)
    check("systemctl enable gpu-medic.service" in commands, "imagebuilder-component.yaml: enables the unit")
    check("systemd-analyze verify" in commands, "imagebuilder-component.yaml: verifies the unit")

    # --- Packer snippet ------------------------------------------------------------------------
    try:
        import hcl2  # type: ignore
    except ImportError:
        hcl2 = None
        if require_hcl:
            errors.append("python-hcl2 is not importable (--require-hcl)")
    if hcl2 is not None:
        with open(PKG / "packer-provisioner.pkr.hcl") as f:
            packer = hcl2.load(f)
        check("build" in packer, "packer-provisioner.pkr.hcl: a build block")
        check(
            "systemctl enable gpu-medic.service" in json.dumps(packer),
            "packer-provisioner.pkr.hcl: enables the unit",
        )

    for e in errors:
        print(f"packaging-lint: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"packaging-lint: ok ({'with' if hcl2 else 'without'} HCL)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
