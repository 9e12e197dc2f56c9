#!/usr/bin/env python3
"""Checks the fake libnvidia-ml (tests/fake-nvml), the NVML bindings gpu-medic links
(nvml-wrapper-sys) and gpu-medic's own NVML constants against NVIDIA's `nvml.h`.

NVIDIA publishes the header on PyPI in its `nvidia-nvml-dev` wheels. This script fetches the
pinned ones (PINS: versions and sha256, the only place they are written) with pip into
target/nvml-header/ and verifies their sha256; once they are there it needs no network (nor
does cargo, once the workspace is built). The header itself is NVIDIA's and is never committed.

For each header it compiles (gcc):
  * the fake's exported functions: every `nvml*` symbol of the built libfake_nvml.so is parsed
    from tests/fake-nvml/src/ffi.rs, its Rust signature turned into a C declaration and
    redeclared after `#include "nvml.h"`: the header must declare the function, and the
    compiler must find the two declarations compatible (else "conflicting types");
  * every struct the fake fills (tests/fake-nvml/src/types.rs, a `#[repr(C)]` type whose doc
    comment names its C type first) and every struct and union of nvml-wrapper-sys's
    bindings: size, alignment and each field's offset as rustc lays them out (`size_of`,
    `align_of`, `offset_of!` in a generated program linked against the built crates) against
    gcc's (`sizeof`, `_Alignof`, and the header's members from the DWARF of a compiled
    `#include "nvml.h"`), in both directions: a field one side has and the other lacks fails;
  * every integer constant of the fake, of nvml-wrapper-sys and of gpu-medic
    (`gpu_medic_io::probe::nvml::header::constants()`) against the value gcc computes for its
    header name.
A mismatch fails (exit 1) naming the function, struct, field or constant. Each pinned header
has a role (Report says what fails where): "target", the NVML 13.0 the fake and the bindings
claim, must have everything the three sides use, with the same values and layouts; "newer",
the latest 13.x, too for the fake and gpu-medic, while the bindings' differences are listed
for an upstream report; "older" (NVML 12.9, drivers before R580) must agree with the fake and
gpu-medic on what it has, and what it lacks is listed.

Then a self-test: the same check on a copy of the first target header with a field moved, a
constant, a prototype and a declaration changed, which must fail naming each.

  python3 scripts/nvml-header-check.py                 fetch (if not cached), check, self-test
  python3 scripts/nvml-header-check.py --no-self-test
  python3 scripts/nvml-header-check.py --verbose       also every note (absent items, etc.)

Needs python3 (stdlib), pip (python3 -m pip, else the CI venv's, else a venv it makes under
target/), gcc, readelf and nm (binutils), cargo and rustc. CI runs it (.ci/run);
docs/conformance.md says what it proves.
"""
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "target" / "nvml-header"

# (PyPI package, version, sha256 of its manylinux2014_x86_64 wheel, role: see Report). The
# header is the same text in every platform's wheel; the x86_64 one is pinned whatever the
# machine. 12.9.79 is CUDA 12.9's (R575), 13.0.87 CUDA 13.0's (R580; nvml-wrapper-sys 0.10 was
# generated from 13.0.39), 13.5.37 the newest on PyPI when pinned (2026-12).
PINS = [
    (
        "nvidia-nvml-dev-cu12",
        "12.9.79",
        "8bb367913c62cb65be9ae386c58dbf573f1f9e2f01cae54abb87bf5f63c6069e",
        "older",
    ),
    (
        "nvidia-nvml-dev",
        "13.0.87",
        "082871368275cf6620fc900f55d8eaf2563b263a38a00a5168e9650bce963ba1",
        "target",
    ),
    (
        "nvidia-nvml-dev",
        "13.5.37",
        "7394fcbefa9ba537e8238cbb1caa4cd2db6bbfbff208d217a8a884947113ae6d",
        "newer",
    ),
]
PLATFORM = "manylinux2014_x86_64"

# gpu-medic's bounds (probe/nvml/header.rs): "at least NAME".
AT_LEAST = "at least "

FAKE_TYPES = ROOT / "tests/fake-nvml/src/types.rs"
FAKE_FFI = ROOT / "tests/fake-nvml/src/ffi.rs"

# The fake's type aliases and the C types they stand for (their size and alignment are checked).
FAKE_ALIASES = {
    "NvmlReturn": "nvmlReturn_t",
    "NvmlDevice": "nvmlDevice_t",
    "NvmlEventSet": "nvmlEventSet_t",
}
RUST_PRIMITIVES = {
    "c_uint": "unsigned int",
    "c_int": "int",
    "c_ulonglong": "unsigned long long",
    "c_longlong": "long long",
    "c_ulong": "unsigned long",
    "c_long": "long",
    "c_ushort": "unsigned short",
    "c_short": "short",
    "c_char": "char",
    "c_void": "void",
    "u8": "unsigned char",
    "u16": "unsigned short",
    "u32": "unsigned int",
    "u64": "unsigned long long",
    "i32": "int",
    "i64": "long long",
    "f64": "double",
}
INTEGER_TYPE = re.compile(r"^(c_u?(char|short|int|long|longlong)|[ui](8|16|32|64|size)|NvmlReturn|\w+_enum|\w+_t)$")

# The fake's constants whose header name follows no rule below, and those with none at all.
FAKE_CONST_NAMES = {
    ("", "VALUE_NOT_AVAILABLE_U64"): "(unsigned long long)NVML_VALUE_NOT_AVAILABLE",
    ("", "MEMORY_V2_VERSION"): "nvmlMemory_v2",
    ("", "FABRIC_INFO_V3_VERSION"): "nvmlGpuFabricInfo_v3",
    ("", "FABRIC_INFO_V2_VERSION"): "nvmlGpuFabricInfo_v2",
    ("value_type", "UINT"): "NVML_VALUE_TYPE_UNSIGNED_INT",
    ("value_type", "ULL"): "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG",
    ("event_type", "PSTATE"): "nvmlEventTypePState",
    ("event_type", "MIG_CONFIG_CHANGE"): "nvmlEventMigConfigChange",
}
FAKE_CONST_UNNAMED = {
    ("", "NO_MIG_INSTANCE"): "0xFFFFFFFF: the header says it in comments of nvmlProcessInfo_t "
    "and nvmlEventData_t, with no name of its own",
}

# nvml-wrapper-sys values that differ from the header on purpose: (name pattern, why). Each is
# still printed; anything else that differs fails.
SYS_KNOWN = [
    (
        re.compile(r"^NVML_FI_\w+$"),
        lambda header, binding: 251 <= header <= 273 and 251 <= binding <= 273,
        "nvml-wrapper-sys 0.10.0 keeps NVML 12's numbers for field ids 251-273 (its CHANGELOG); "
        "nvml-wrapper maps them per driver (FieldIdScheme::V13Update1 from 580.82). gpu-medic "
        "reads none of them.",
    ),
]


class Failure(Exception):
    pass


def run(cmd, **kw):
    kw.setdefault("check", True)
    kw.setdefault("text", True)
    kw.setdefault("capture_output", True)
    try:
        return subprocess.run(cmd, **kw)
    except subprocess.CalledProcessError as e:
        raise Failure(f"{' '.join(map(str, cmd))} failed ({e.returncode}):\n{e.stderr or ''}{e.stdout or ''}")
    except FileNotFoundError:
        raise Failure(f"{cmd[0]} not found: the check needs it (see this script's doc)")


def camel(snake):
    head, *rest = snake.split("_")
    return head + "".join(w[:1].upper() + w[1:].lower() for w in rest)


# ------------------------------------------------------------------------------ the headers


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            h.update(block)
    return h.hexdigest()


def find_pip():
    venv = Path(os.environ.get("GPU_MEDIC_CI_VENV", "/opt/gpu-medic-ci/venv"))
    for py in [sys.executable, str(venv / "bin/python"), str(CACHE / "venv/bin/python")]:
        if Path(py).exists() and subprocess.run([py, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return py
    # A fresh machine without pip for this python: a venv of our own (python3-venv brings pip).
    run([sys.executable, "-m", "venv", str(CACHE / "venv")])
    return str(CACHE / "venv/bin/python")


def wheel(pkg, version, digest):
    """The cached wheel of a pin, fetched first if missing; its sha256 verified either way."""
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    stem = f"{pkg.replace('-', '_')}-{version}-"
    cached = [p for p in wheels.glob(f"{stem}*.whl") if sha256(p) == digest]
    if cached:
        return cached[0]
    req = wheels / f"{pkg}-{version}.requirements.txt"
    req.write_text(f"{pkg}=={version} --hash=sha256:{digest}\n")
    py = find_pip()
    print(f"fetching {pkg}=={version} from PyPI ...", flush=True)
    run([py, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-input",
         "--no-deps", "--only-binary=:all:", "--platform", PLATFORM, "--python-version", "3",
         "--require-hashes", "-r", str(req), "-d", str(wheels)])
    cached = [p for p in wheels.glob(f"{stem}*.whl") if sha256(p) == digest]
    if not cached:
        raise Failure(f"{pkg}=={version}: no wheel with sha256 {digest} after pip download")
    return cached[0]


def header(pkg, version, digest):
    whl = wheel(pkg, version, digest)
    out = CACHE / "headers" / f"{pkg}-{version}" / "nvml.h"
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if n.endswith("/include/nvml.h")]
        if len(names) != 1:
            raise Failure(f"{whl.name}: expected one include/nvml.h, found {names}")
        data = z.read(names[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists() or out.read_bytes() != data:
        out.write_bytes(data)
    return out


# ------------------------------------------------------------------------------ the Rust side


def rust_items(text, path):
    """Structs/unions (name -> kind, doc, repr_c, fields [(name, type)]), consts
    ((module, name) -> type), type aliases (name -> type) of a rustfmt-formatted file."""
    structs, consts, aliases = {}, {}, {}
    lines = text.split("\n")
    doc, attrs, module = [], [], []
    i = 0
    while i < len(lines):
        raw = lines[i]
        line = raw.strip()
        if line.startswith("///"):
            doc.append(line[3:].strip())
        elif line.startswith("#["):
            attrs.append(line)
        else:
            m = re.match(r"pub (struct|union) (\w+) \{$", line)
            mm = re.match(r"pub mod (\w+) \{$", line)
            if m:
                fields = []
                repr_c = any(a.startswith("#[repr(C") for a in attrs)
                i += 1
                end = raw[: len(raw) - len(raw.lstrip())] + "}"
                while lines[i].rstrip() != end:
                    if i + 1 >= len(lines):
                        raise Failure(f"{path}: {m.group(2)} has no closing brace at its indentation")
                    f = lines[i].strip()
                    fm = re.match(r"(?:pub )?(\w+): (.+),$", f)
                    if fm:
                        fields.append((fm.group(1), fm.group(2)))
                    elif f and not f.startswith("//") and repr_c:
                        raise Failure(f"{path}:{i + 1}: cannot read this field: {f}")
                    i += 1
                structs[m.group(2)] = {"kind": m.group(1), "doc": " ".join(doc), "repr_c": repr_c, "fields": fields}
            elif mm:
                module.append(mm.group(1))
            elif line == "}" and module and not raw.startswith(" "):
                module.pop()
            else:
                cm = re.match(r"pub const (\w+): ([\w:&\[\]; ]+?) =", line)
                tm = re.match(r"pub type (\w+) = (.+);$", line)
                if cm:
                    consts[("::".join(module), cm.group(1))] = cm.group(2).strip()
                elif tm:
                    aliases[tm.group(1)] = tm.group(2)
            doc, attrs = [], []
        i += 1
    return structs, consts, aliases


def fake_functions(text):
    """(name, [(param, rust type)], rust return type) of every `#[unsafe(no_mangle)]` fn."""
    out = []
    pat = re.compile(
        r'#\[unsafe\(no_mangle\)\]\s*pub (?:unsafe )?extern "C" fn (\w+)\((.*?)\)(?:\s*->\s*([^{]+?))?\s*\{',
        re.S,
    )
    for m in pat.finditer(text):
        params = []
        for p in [p.strip() for p in m.group(2).split(",") if p.strip()]:
            name, _, ty = p.partition(":")
            params.append((name.strip(), ty.strip()))
        out.append((m.group(1), params, (m.group(3) or "()").strip()))
    return out


def declarations(functions, fake_c):
    """(name, its C declaration written from the Rust signature) of each exported function."""
    out = []
    for name, params, ret in functions:
        args = ", ".join(f"{c_of(t, fake_c)} {p.lstrip('_') or 'arg'}" for p, t in params) or "void"
        out.append((name, f"{c_of(ret, fake_c)} {name}({args});"))
    return out


def c_of(rust_type, structs_c):
    t = rust_type.strip()
    if t.startswith("*mut "):
        return c_of(t[5:], structs_c) + " *"
    if t.startswith("*const "):
        return "const " + c_of(t[7:], structs_c) + " *"
    if t == "()":
        return "void"
    for table in (FAKE_ALIASES, RUST_PRIMITIVES, structs_c):
        if t in table:
            return table[t]
    raise Failure(f"the fake uses Rust type {t} in an exported signature: no C type known for it "
                  "(add it to RUST_PRIMITIVES, FAKE_ALIASES or a #[repr(C)] struct in types.rs)")


def cargo_artifacts():
    """Builds the workspace's tests as scripts/test.sh does (nothing new once they are built)
    and returns {crate name: [files]} of the libraries the generated program links."""
    cmd = ["cargo", "test", "--workspace", "--locked", "--no-run",
           "--message-format=json-render-diagnostics"]
    p = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE)
    if p.returncode != 0:
        raise Failure(f"{' '.join(cmd)} failed ({p.returncode})")
    found = {}
    for line in p.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") != "compiler-artifact" or msg["profile"]["test"]:
            continue
        name = msg["target"]["name"].replace("-", "_")
        if name in ("fake_nvml", "nvml_wrapper_sys", "gpu_medic_io"):
            entry = found.setdefault(name, {"files": set(), "manifest": msg["manifest_path"]})
            entry["files"].update(msg["filenames"])
    for need in ("fake_nvml", "nvml_wrapper_sys", "gpu_medic_io"):
        if need not in found:
            raise Failure(f"cargo built no {need} library")
    return found


def rlib(found, name):
    libs = [f for f in found[name]["files"] if f.endswith(".rlib")]
    if len(libs) != 1:
        raise Failure(f"expected one rlib of {name}, cargo reports {sorted(found[name]['files'])}")
    return libs[0]


def rust_side():
    found = cargo_artifacts()
    so = [f for f in found["fake_nvml"]["files"] if f.endswith(".so")]
    if len(so) != 1:
        raise Failure(f"expected one libfake_nvml.so, cargo reports {sorted(found['fake_nvml']['files'])}")
    sys_dir = Path(found["nvml_wrapper_sys"]["manifest"]).parent
    bindings = sys_dir / "src" / "bindings.rs"

    fake_structs, fake_consts, fake_aliases = rust_items(FAKE_TYPES.read_text(), FAKE_TYPES)
    sys_structs, sys_consts, _ = rust_items(bindings.read_text(), bindings)

    # The fake's structs and the C type each stands for (first `name` of its doc comment).
    fake_c = {}
    for name, s in fake_structs.items():
        if not s["repr_c"]:
            continue
        m = re.search(r"`(nvml\w+_t)`", s["doc"])
        if not m:
            raise Failure(f"{FAKE_TYPES}: #[repr(C)] {name} has no C type (`nvml..._t`) first in its doc comment")
        fake_c[name] = m.group(1)
    for alias in fake_aliases:
        if alias not in FAKE_ALIASES:
            raise Failure(f"{FAKE_TYPES}: type alias {alias}: add its C type to FAKE_ALIASES")

    # Its exported functions, against the symbols the built library really exports.
    functions = fake_functions(FAKE_FFI.read_text())
    exported = set(run(["nm", "-D", "--defined-only", "--format=posix", so[0]]).stdout.split("\n"))
    exported = {l.split()[0] for l in exported if l.startswith("nvml")}
    parsed = {f[0] for f in functions}
    if exported != parsed:
        raise Failure(f"{so[0]} exports {sorted(exported - parsed)} that {FAKE_FFI} does not define as "
                      f"#[unsafe(no_mangle)] pub extern \"C\" fn, or the other way round: {sorted(parsed - exported)}")
    decls = declarations(functions, fake_c)

    # The constants: the fake's by the naming rules, nvml-wrapper-sys's by bindgen's.
    consts = []  # (side, rust path, C expression)
    notes = []
    for (mod, name), ty in fake_consts.items():
        if not INTEGER_TYPE.match(ty):
            continue
        path = f"fake_nvml::types::{mod + '::' if mod else ''}{name}"
        key = (mod, name)
        if key in FAKE_CONST_UNNAMED:
            notes.append(f"fake constant {name}: not checked ({FAKE_CONST_UNNAMED[key]})")
            continue
        if key in FAKE_CONST_NAMES:
            c = FAKE_CONST_NAMES[key]
        elif mod == "" and (name == "SUCCESS" or name.startswith(("ERROR_", "FEATURE_"))):
            c = "NVML_" + name
        elif mod == "event_type":
            c = "nvmlEventType" + camel("x_" + name.lower())[1:]
        elif mod == "fabric_state":
            c = "NVML_GPU_FABRIC_STATE_" + name
        elif mod == "field":
            c = "NVML_FI_DEV_" + name
        else:
            raise Failure(f"{FAKE_TYPES}: constant {mod}::{name}: no header name (add a rule or FAKE_CONST_NAMES)")
        consts.append(("fake", path, c))
    for (mod, name), ty in sys_consts.items():
        if not INTEGER_TYPE.match(ty):
            continue
        c = name[len(ty) + 1:] if name.startswith(ty + "_") else name
        path = f"nvml_wrapper_sys::bindings::{mod + '::' if mod else ''}{name}"
        consts.append(("sys", path, c))

    # The sys structs to compare: every repr(C) struct and union but opaque ones.
    sys_c = {n: s for n, s in sys_structs.items() if s["repr_c"] and s["fields"] and s["fields"][0][0] != "_unused"}

    program = generate_rust(fake_structs, fake_c, sys_c, consts)
    src = CACHE / "layouts.rs"
    exe = CACHE / "layouts"
    src.write_text(program)
    deps = str(Path(rlib(found, "gpu_medic_io")).parent)
    run(["rustc", "--edition", "2024", "-A", "warnings", "-C", "debuginfo=0", "-o", str(exe), str(src),
         "--extern", f"fake_nvml={rlib(found, 'fake_nvml')}",
         "--extern", f"nvml_wrapper_sys={rlib(found, 'nvml_wrapper_sys')}",
         "--extern", f"gpu_medic_io={rlib(found, 'gpu_medic_io')}",
         "-L", f"dependency={deps}"], cwd=ROOT)
    out = json.loads(run([str(exe)]).stdout)

    structs = []  # (side, rust name, C type name or nested path, size, align, [(rust field, C field, offset)])
    for s in out["structs"]:
        side, rname = s["side"], s["name"]
        if side == "fake":
            cname = fake_c[rname]
            fields = [(f, camel(f), o) for f, o in s["fields"]]
        else:
            cname = rname
            fields = [(f, f, o) for f, o in s["fields"]]
        structs.append((side, rname, cname, s["size"], s["align"], fields))
    aliases = [(a["name"], FAKE_ALIASES[a["name"]], a["size"], a["align"]) for a in out["aliases"]]
    values = [(side, path, c, v) for (side, path, c), v in zip(consts, out["consts"])]
    values += [("gpu-medic", "gpu_medic_io::probe::nvml::header::constants()", c, v) for c, v in out["gpu_medic"]]
    return {
        "functions": decls,
        "fake_c": fake_c,
        "structs": structs,
        "aliases": aliases,
        "consts": values,
        "notes": notes,
        "sys_nested": {n: s for n, s in sys_c.items() if "__bindgen_ty_" in n},
        "sys_fields": {n: dict(s["fields"]) for n, s in sys_c.items()},
    }


def generate_rust(fake_structs, fake_c, sys_c, consts):
    out = ["use std::mem::{align_of, offset_of, size_of};", "",
           "fn s(side: &str, name: &str, size: usize, align: usize, fields: &[(&str, usize)]) -> String {",
           "    let f: Vec<String> = fields.iter().map(|(n, o)| format!(\"[\\\"{n}\\\", {o}]\")).collect();",
           "    format!(\"{{\\\"side\\\": \\\"{side}\\\", \\\"name\\\": \\\"{name}\\\", \\\"size\\\": {size}, \\\"align\\\": {align}, \\\"fields\\\": [{}]}}\", f.join(\", \"))",
           "}", "",
           "fn main() {", "    let structs = [",
           ]
    for side, table, prefix in (("fake", {n: fake_structs[n] for n in fake_c}, "fake_nvml::types::"),
                                ("sys", sys_c, "nvml_wrapper_sys::bindings::")):
        for name, st in table.items():
            t = prefix + name
            fields = ", ".join(f'("{f}", offset_of!({t}, {f}))' for f, _ in st["fields"])
            out.append(f'        s("{side}", "{name}", size_of::<{t}>(), align_of::<{t}>(), &[{fields}]),')
    out.append("    ];")
    out.append("    let aliases = [")
    for a in FAKE_ALIASES:
        t = "fake_nvml::types::" + a
        out.append(f'        format!("{{{{\\"name\\": \\"{a}\\", \\"size\\": {{}}, \\"align\\": {{}}}}}}", size_of::<{t}>(), align_of::<{t}>()),')
    out.append("    ];")
    out.append("    let consts: Vec<u64> = vec![")
    for _, path, _ in consts:
        out.append(f"        {path} as u64,")
    out.append("    ];")
    out.append("    let ours: Vec<String> = gpu_medic_io::probe::nvml::header::constants()")
    out.append("        .into_iter()")
    out.append("        .map(|(n, v)| format!(\"[{n:?}, {v}]\"))")
    out.append("        .collect();")
    out.append('    println!("{{\\"structs\\": [{}], \\"aliases\\": [{}], \\"consts\\": {:?}, \\"gpu_medic\\": [{}]}}",')
    out.append('        structs.join(", "), aliases.join(", "), consts, ours.join(", "));')
    out.append("}")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ the C side


def dwarf_types(header_path, workdir):
    """The header's structs, unions and typedefs as gcc lays them out (DWARF of a compiled
    `#include`, every type kept), and its enumerator names."""
    tu = workdir / "types.c"
    obj = workdir / "types.o"
    tu.write_text('#define NVML_NO_UNVERSIONED_FUNC_DEFS\n#include "nvml.h"\n')
    run(["gcc", "-std=gnu11", "-g", "-gdwarf-4", "-fno-eliminate-unused-debug-types", "-c", str(tu),
         "-I", str(header_path.parent), "-o", str(obj)])
    text = run(["readelf", "--debug-dump=info", str(obj)]).stdout
    dies, stack = {}, []
    cur = None
    die_re = re.compile(r"^\s*<(\d+)><([0-9a-f]+)>: Abbrev Number: (\d+)(?: \((DW_TAG_\w+)\))?")
    attr_re = re.compile(r"^\s*<[0-9a-f]+>\s+(DW_AT_\w+)\s*: (.*)$")
    for line in text.splitlines():
        m = die_re.match(line)
        if m:
            depth, off, tag = int(m.group(1)), int(m.group(2), 16), m.group(4)
            del stack[depth:]
            if tag is None:
                cur = None
                continue
            cur = {"tag": tag, "off": off, "children": []}
            dies[off] = cur
            if stack:
                stack[-1]["children"].append(cur)
            stack.append(cur)
            continue
        a = attr_re.match(line)
        if a and cur is not None:
            key, val = a.group(1), a.group(2).strip()
            # readelf writes `(form) value` with --wide or newer binutils, `value` otherwise.
            val = re.sub(r"^\((?:data\d|udata|sdata|strp|string|line_strp|strx\d?|ref\d|ref_udata|flag_present|flag)\)\s*", "", val)
            if key == "DW_AT_name":
                sm = re.match(r"^\((?:indirect |indexed )?(?:line )?(?:string, )?offset: (?:0x)?[0-9a-f]+\): (.*)$", val)
                cur["name"] = sm.group(1) if sm else val
            elif key == "DW_AT_type":
                tm = re.search(r"<0x([0-9a-f]+)>", val)
                cur["type"] = int(tm.group(1), 16) if tm else None
            elif key in ("DW_AT_byte_size", "DW_AT_data_member_location"):
                nm = re.search(r"(-?\d+)\s*$", val)
                cur["size" if key == "DW_AT_byte_size" else "offset"] = int(nm.group(1)) if nm else None
            elif key == "DW_AT_declaration":
                cur["decl"] = True
    tags, typedefs, enumerators = {}, {}, set()
    for d in dies.values():
        if d["tag"] in ("DW_TAG_structure_type", "DW_TAG_union_type") and "name" in d and not d.get("decl"):
            tags[d["name"]] = d
        elif d["tag"] == "DW_TAG_typedef" and "name" in d and "type" in d:
            typedefs[d["name"]] = d["type"]
        elif d["tag"] == "DW_TAG_enumerator":
            enumerators.add(d["name"])
    return dies, tags, typedefs, enumerators


class Header:
    def __init__(self, pkg, version, role, path, workdir):
        self.label = f"nvml.h {version} ({pkg}, {role})"
        self.version, self.role, self.path, self.workdir = version, role, path, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.dies, self.tags, self.typedefs, self.enumerators = dwarf_types(path, workdir)
        defines = run(["gcc", "-E", "-dM", "-DNVML_NO_UNVERSIONED_FUNC_DEFS", "-x", "c", str(path)]).stdout
        self.macros = {l.split()[1].split("(")[0] for l in defines.splitlines() if l.startswith("#define ")}
        self.text = path.read_text(errors="replace")

    def strip(self, off):
        d = self.dies.get(off)
        while d is not None and d["tag"] in ("DW_TAG_typedef", "DW_TAG_const_type", "DW_TAG_volatile_type",
                                             "DW_TAG_array_type") and "type" in d:
            d = self.dies.get(d["type"])
        return d

    def record(self, name):
        """The struct/union DIE a typedef or tag name stands for, or None."""
        if name in self.typedefs:
            d = self.strip(self.typedefs[name])
        else:
            d = self.tags.get(name)
        if d is None or d["tag"] not in ("DW_TAG_structure_type", "DW_TAG_union_type"):
            return None
        return d

    def c_name(self, name):
        """A C type expression for a typedef or tag name."""
        if name in self.typedefs:
            return name
        d = self.tags[name]
        return ("struct " if d["tag"] == "DW_TAG_structure_type" else "union ") + name

    def known(self, expr):
        idents = re.findall(r"[A-Za-z_]\w*", expr)
        keywords = {"unsigned", "long", "int", "char", "short", "signed"}
        return [i for i in idents if i not in keywords and i not in self.macros and i not in self.enumerators]

    def deprecated(self, fn):
        return re.search(r"DEPRECATED\([^)]*\)\s*nvmlReturn_t\s+DECLDIR\s+" + re.escape(fn) + r"\s*\(", self.text) is not None


def members(d):
    """A struct's or union's members by name (C's unnamed ones as bindgen names them,
    `__bindgen_anon_1`, `_2`, ... in order): their DIEs, each with its offset (0 in a union;
    None for a bit-field)."""
    out, k = {}, 0
    union = d["tag"] == "DW_TAG_union_type"
    for c in d["children"]:
        if c["tag"] != "DW_TAG_member":
            continue
        name = c.get("name")
        if name is None:
            k += 1
            name = f"__bindgen_anon_{k}"
        out[name] = dict(c, offset=0 if union else c.get("offset"))
    return out


def nested_record(h, rust, nested, sys_fields):
    """The C record a bindgen `Parent__bindgen_ty_N` stands for: the type of the parent's member
    of that type, and a C expression of it for `_Alignof`."""
    parent = rust.rsplit("__bindgen_ty_", 1)[0]
    member = next((f for f, t in sys_fields.get(parent, {}).items() if re.search(r"\b" + re.escape(rust) + r"\b", t)), None)
    if member is None:
        return None, None
    if parent in nested:
        pd, pexpr = nested_record(h, parent, nested, sys_fields)
    else:
        pd = h.record(parent)
        pexpr = f"(({h.c_name(parent)} *)0)" if pd else None
    if pd is None:
        return None, None
    child = members(pd).get(member)
    if child is None:
        return None, None
    d = h.strip(child.get("type"))
    if pexpr is None or "name" not in child:
        return d, None  # C cannot name an unnamed member: its alignment is not compared
    array = h.dies.get(child.get("type"), {}).get("tag") == "DW_TAG_array_type"
    return d, f"__typeof__(({pexpr}->{member}{'[0]' if array else ''}))"


# ------------------------------------------------------------------------------ comparing


class Report:
    """What one header says about each side, sorted by the header's role:

    side        mismatch                       absent from the header
    fake        fails                          fails (target, newer); listed (older)
    gpu-medic   fails                          fails (target, newer); listed (older)
    sys         fails (target), unless known;  listed
                listed for upstream (newer);
                listed (older)
    """

    def __init__(self, header):
        self.h = header
        self.fail, self.upstream, self.absent, self.notes = [], [], [], []
        self.known = {}  # why -> the bindings' differences it explains

    def mismatch(self, side, msg, known=None):
        if side != "sys":
            self.fail.append(msg)
        elif known:
            self.known.setdefault(known, []).append(msg)
        elif self.h.role == "target":
            self.fail.append(f"{msg}\n    {UPSTREAM}")
        elif self.h.role == "newer":
            self.upstream.append(msg)
        else:
            self.absent.append(f"{msg} (an older header than the bindings')")

    def missing(self, side, msg):
        if side != "sys" and self.h.role in ("target", "newer"):
            self.fail.append(msg)
        else:
            self.absent.append(msg)


UPSTREAM = ("upstream: the bindings (nvml-wrapper-sys, generated from NVML 13.0.39) disagree with this "
            "header: report to github.com/rust-nvml/nvml-wrapper; here: gpu-medic's own code takes the "
            "header's value (probe/nvml/header.rs), never the binding's")


def check_header(h, rust):
    rep = Report(h)
    compare_records(h, rep, rust)
    compare_constants(h, rep, rust)
    compare_functions(h, rep, rust)
    return rep


def compare_records(h, rep, rust):
    checks = []  # (label, C type expr, rust size, rust align, fields, C record)
    for side, rname, cname, size, align, fields in rust["structs"]:
        who = "the fake" if side == "fake" else "nvml-wrapper-sys"
        label = f"{'fake' if side == 'fake' else 'nvml-wrapper-sys'} struct {cname}"
        rust_of = (lambda f, rname=rname: f" ({rname}.{f})") if side == "fake" else (lambda f: "")
        if side == "sys" and rname in rust["sys_nested"]:
            d, expr = nested_record(h, rname, rust["sys_nested"], rust["sys_fields"])
        else:
            d = h.record(cname)
            expr = h.c_name(cname) if d else None
        if d is None:
            rep.missing(side, f"{label}: not in {h.label}")
            continue
        checks.append((label, who, expr, size, align, fields, d, side, rust_of))
    aligns = c_values(h, [f"_Alignof({c[2]})" if c[2] else "0" for c in checks] + [f"sizeof({a[1]})" for a in rust["aliases"]]
                      + [f"_Alignof({a[1]})" for a in rust["aliases"]], "align")
    for i, (label, who, expr, size, align, fields, d, side, rust_of) in enumerate(checks):
        bad = []
        if d.get("size") != size:
            bad.append(f"{label}: size {d.get('size')} in {h.label}, {size} in {who}")
        if expr is None:
            rep.notes.append(f"{label}: alignment not compared (C cannot name an unnamed member's type)")
        elif aligns[i] != align:
            bad.append(f"{label}: alignment {aligns[i]} in {h.label}, {align} in {who}")
        cmem = {n: c["offset"] for n, c in members(d).items()}
        matched = set()
        for rf, cf, off in fields:
            name = cf if cf in cmem else (cf.rstrip("_") if cf.rstrip("_") in cmem else None)
            if name is None:
                bad.append(f"{label}.{cf}: in {who}{rust_of(rf)}, not in {h.label}")
                continue
            matched.add(name)
            if cmem[name] is None:
                rep.notes.append(f"{label}.{name}: a bit-field, its offset not compared")
            elif cmem[name] != off:
                bad.append(f"{label}.{name}: offset {cmem[name]} in {h.label}, {off} in {who}{rust_of(rf)}")
        for cf in cmem:
            if cf not in matched:
                bad.append(f"{label}.{cf or '<anonymous member>'}: in {h.label}, not in {who}")
        for b in bad:
            rep.mismatch(side, b)
    n = len(checks)
    for j, (rname, cname, size, align) in enumerate(rust["aliases"]):
        csize, calign = aligns[n + j], aligns[n + len(rust["aliases"]) + j]
        if (csize, calign) != (size, align):
            rep.mismatch("fake", f"fake type {rname} for {cname}: size/alignment {csize}/{calign} in {h.label}, {size}/{align} in the fake")


def c_values(h, exprs, what):
    """Values gcc computes for C expressions after `#include "nvml.h"`."""
    if not exprs:
        return []
    src = h.workdir / f"{what}.c"
    exe = h.workdir / what
    body = "\n".join(f"    printf(\"%llu\\n\", (unsigned long long)({e}));" for e in exprs)
    src.write_text(f'#define NVML_NO_UNVERSIONED_FUNC_DEFS\n#include <stdio.h>\n#include "nvml.h"\nint main(void) {{\n{body}\n    return 0;\n}}\n')
    run(["gcc", "-std=gnu11", "-w", "-o", str(exe), str(src), "-I", str(h.path.parent)])
    vals = [int(x) for x in run([str(exe)]).stdout.split()]
    if len(vals) != len(exprs):
        raise Failure(f"{src}: expected {len(exprs)} values, got {len(vals)}")
    return vals


def sys_known(c, header, binding):
    for pat, when, why in SYS_KNOWN:
        if pat.match(c) and when(header, binding):
            return why
    return None


def compare_constants(h, rep, rust):
    """Each constant's value, as an unsigned 64-bit word on both sides. A gpu-medic entry named
    `at least NAME` holds a bound: its value must be NAME's or more."""
    present = []
    for side, path, c, v in rust["consts"]:
        bound = c.startswith(AT_LEAST)
        expr = c[len(AT_LEAST):] if bound else c
        missing = h.known(expr)
        if missing:
            rep.missing(side, f"{side} constant {c} ({path}): {', '.join(missing)} not in {h.label}")
            continue
        present.append((side, path, c, v, expr, bound))
    got = c_values(h, [p[4] for p in present], "consts")
    for (side, path, c, v, expr, bound), hv in zip(present, got):
        ours = v % (1 << 64)
        if hv == ours or (bound and ours >= hv):
            continue
        what = "less than" if bound else "not"
        msg = f"{side} constant {expr}: {hv:#x} ({hv}) in {h.label}, {what} {ours:#x} ({v}) in {path}"
        rep.mismatch(side, msg, sys_known(c, hv, ours) if side == "sys" else None)


def compare_functions(h, rep, rust):
    lines = ['#define NVML_NO_UNVERSIONED_FUNC_DEFS', '#include "nvml.h"']
    where = {}
    for name, decl in rust["functions"]:
        where[len(lines) + 1] = (name, "present", decl)
        lines.append(f"static void *const present_{name} = (void *)&{name};")
        where[len(lines) + 1] = (name, "decl", decl)
        lines.append(decl)
        if h.deprecated(name):
            rep.notes.append(f"fake function {name}: deprecated in {h.label}")
    src = h.workdir / "functions.c"
    src.write_text("\n".join(lines) + "\n")
    p = subprocess.run(["gcc", "-std=gnu11", "-fsyntax-only", "-fmax-errors=0", "-w", str(src), "-I", str(h.path.parent)],
                       capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"))
    seen = set()
    for line in p.stderr.splitlines():
        m = re.match(re.escape(str(src)) + r":(\d+):\d+: error: (.*)$", line)
        if not m:
            continue
        name, kind, decl = where.get(int(m.group(1)), (None, None, None))
        if name is None:
            raise Failure(f"{src}: {line}")
        if (name, kind) in seen:
            continue
        seen.add((name, kind))
        err = m.group(2)
        if kind == "present" and "undeclared" in err:
            rep.missing("fake", f"fake function {name}: not declared in {h.label}")
        elif kind == "decl" and "unknown type name" in err:
            rep.missing("fake", f"fake function {name}: {err} in {h.label} (the fake declares {decl})")
        elif kind == "decl" and (name, "present") not in seen:
            rep.mismatch("fake", f"fake function {name}: {err} (the fake: {decl})")
    if p.returncode != 0 and not seen:
        raise Failure(f"gcc failed on {src}:\n{p.stderr}")


# ------------------------------------------------------------------------------ the runs


def print_report(rep, rust, verbose):
    counts = (f"{len(rust['functions'])} fake functions, {sum(1 for s in rust['structs'] if s[0] == 'fake')} fake structs, "
              f"{sum(1 for s in rust['structs'] if s[0] == 'sys')} nvml-wrapper-sys structs and unions, "
              f"constants: {sum(1 for c in rust['consts'] if c[0] == 'fake')} of the fake, "
              f"{sum(1 for c in rust['consts'] if c[0] == 'sys')} of nvml-wrapper-sys, "
              f"{sum(1 for c in rust['consts'] if c[0] == 'gpu-medic')} of gpu-medic")
    print(f"{rep.h.label}: {counts}: {'FAIL' if rep.fail else 'ok'}")
    for f in rep.fail:
        print(f"  FAIL {f}")
    for n in rep.upstream:
        print(f"  bindings: {n}")
    if rep.upstream:
        print(f"    {UPSTREAM}")
    for why, msgs in rep.known.items():
        print(f"  bindings: {len(msgs)} known differences, e.g. {msgs[0]}\n    known: {why}")
        if verbose:
            for m in msgs[1:]:
                print(f"    {m}")
    if verbose:
        for n in rep.notes + rep.absent:
            print(f"  note {n}")
    elif rep.notes or rep.absent:
        print(f"  ({len(rep.absent)} items this header lacks or predates, {len(rep.notes)} notes: --verbose lists them)")


def self_test(target, rust, workdir):
    """The checker on a copy of a target header with known defects; each must be named."""
    text = target.path.read_text()
    mutations = [
        ("a field moved", re.compile(r"(struct nvmlPciInfo_st\s*\{[^}]*?)(\n\s*unsigned int domain;[^\n]*)(\n\s*unsigned int bus;[^\n]*)"),
         lambda m: m.group(1) + m.group(3) + m.group(2), "nvmlPciInfo_t.domain: offset 20"),
        ("a constant changed", re.compile(r"(#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION\s+)230"),
         lambda m: m.group(1) + "231", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: 0xe7"),
        ("a prototype changed", re.compile(r"(nvmlDeviceGetUUID\(nvmlDevice_t device, char \*uuid, )unsigned int length"),
         lambda m: m.group(1) + "unsigned long length", "fake function nvmlDeviceGetUUID: conflicting types"),
        ("a declaration removed", re.compile(r"DECLDIR nvmlDeviceGetRowRemapperHistogram\("),
         lambda m: "DECLDIR nvmlDeviceGetRowRemapperHistogramGone(", "fake function nvmlDeviceGetRowRemapperHistogram: not declared"),
    ]
    for what, pat, repl, _ in mutations:
        text, n = pat.subn(repl, text, count=1)
        if n != 1:
            raise Failure(f"self-test: cannot apply '{what}' to {target.path}")
    mdir = workdir / "self-test"
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / "nvml.h").write_text(text)
    mutated = Header("self-test", target.version + "-mutated", "target", mdir / "nvml.h", mdir / "work")
    rep = check_header(mutated, rust)
    missed = [f"{what} (expected a failure containing {want!r})" for what, _, _, want in mutations
              if not any(want in f for f in rep.fail)]
    # And on the Rust side: the real header against a fake whose signature changed (one
    # parameter's type), declared from a changed copy of ffi.rs.
    ffi = FAKE_FFI.read_text()
    changed = re.sub(r"(fn nvmlDeviceGetSerial\(\s*device: NvmlDevice,\s*serial: \*mut c_char,\s*length: )c_uint", r"\1u64", ffi, count=1)
    if changed == ffi:
        raise Failure(f"self-test: cannot change nvmlDeviceGetSerial's signature in {FAKE_FFI}")
    rust_changed = dict(rust, functions=declarations(fake_functions(changed), rust["fake_c"]))
    side = Report(target)
    compare_functions(target, side, rust_changed)
    want = "fake function nvmlDeviceGetSerial: conflicting types"
    if not any(want in f for f in side.fail):
        missed.append(f"a fake signature changed (expected a failure containing {want!r})")
    rep.fail += side.fail
    if missed:
        print("self-test: FAIL, the checker did not catch:")
        for m in missed:
            print(f"  {m}")
        print("  it reported:\n    " + "\n    ".join(rep.fail))
        return False
    print(f"self-test: ok (a header with {', '.join(m[0] for m in mutations)}, and a fake with a "
          f"parameter's type changed: each named, e.g. {rep.fail[0]})")
    return True


def main(argv):
    verbose = "--verbose" in argv
    try:
        headers = [(pkg, ver, role, header(pkg, ver, digest)) for pkg, ver, digest, role in PINS]
        rust = rust_side()
        for n in rust["notes"]:
            print(f"note {n}")
        ok = True
        first_target = None
        for pkg, ver, role, path in headers:
            h = Header(pkg, ver, role, path, CACHE / "work" / f"{pkg}-{ver}")
            rep = check_header(h, rust)
            print_report(rep, rust, verbose)
            ok = ok and not rep.fail
            if role == "target" and first_target is None:
                first_target = h
        if "--no-self-test" not in argv:
            ok = self_test(first_target, rust, CACHE / "work") and ok
    except Failure as e:
        print(f"nvml-header-check: {e}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
