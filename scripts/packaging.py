#!/usr/bin/env python3
"""Builds the gpu-medic deb and RPM from Cargo.toml, with Debian's own tools.

    python3 scripts/packaging.py [--target-dir DIR] [--manifest-path Cargo.toml] [all|deb|rpm]

Reads [package.metadata.deb] and [package.metadata.generate-rpm] (the keys cargo-deb and
cargo-generate-rpm read, the subset this project uses) and writes

    <target-dir>/debian/<name>_<version>-<revision>_<arch>.deb         (dpkg-deb)
    <target-dir>/generate-rpm/<name>-<version>-<release>.<arch>.rpm     (rpmbuild)

printing each path on stdout (deb first); progress goes to stderr. The release binary is taken as
built: an asset source under target/ is read from the target dir. Nothing is compiled: the tools
are dpkg-deb, dpkg-shlibdeps (apt: dpkg-dev) and rpmbuild (apt: rpm). A key this script does not
implement is an error, not silently dropped.

deb, as cargo-deb built it: the assets with their modes, all owned by root; a generated
usr/share/doc/<name>/copyright; every file under /etc a conffile (plus conf-files); the maintainer
scripts from maintainer-scripts, as they are (a #DEBHELPER# token is an error: write the systemd
snippets into the scripts); a control file with the same fields (Depends: $auto is what
`dpkg-shlibdeps -xlibgcc` says of each ELF asset, libgcc dropped, plus the listed ones, sorted);
and DEBIAN/md5sums (conffiles excepted, as dh_md5sums does).

RPM, as cargo-generate-rpm built it: a spec with the assets (mode, user, group, %config,
%config(noreplace), %doc, %caps; files only, no directories), Requires (/bin/sh unless
require-sh = false, the requires table, and rpmbuild's automatic ELF requirements unless
auto-req = "no"), the scriptlets (a file path or the script text), no %build, and nothing
stripped, compressed or split off by rpmbuild (no debuginfo, no build-id links).

SOURCE_DATE_EPOCH, when set, clamps file times in both packages; otherwise the deb's file times
are Cargo.toml's modification day, as cargo-deb's were.
"""

import argparse
import glob
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# platform.machine() -> (Debian architecture, RPM architecture)
ARCHES = {
    "x86_64": ("amd64", "x86_64"),
    "amd64": ("amd64", "x86_64"),
    "aarch64": ("arm64", "aarch64"),
    "arm64": ("arm64", "aarch64"),
}

DEB_KEYS = {
    "name", "maintainer", "copyright", "section", "priority", "revision", "depends",
    "pre-depends", "recommends", "suggests", "enhances", "conflicts", "breaks", "replaces",
    "provides", "extended-description", "extended-description-file", "maintainer-scripts",
    "assets", "conf-files",
}
DEB_ASSET_KEYS = {"source", "dest", "mode"}
# Control fields after Depends, in cargo-deb's order.
DEB_RELATION_FIELDS = [
    ("pre-depends", "Pre-Depends"), ("recommends", "Recommends"), ("suggests", "Suggests"),
    ("enhances", "Enhances"), ("conflicts", "Conflicts"), ("breaks", "Breaks"),
    ("replaces", "Replaces"), ("provides", "Provides"),
]
DEB_SCRIPTS = {"config": 0o755, "preinst": 0o755, "postinst": 0o755, "prerm": 0o755,
               "postrm": 0o755, "templates": 0o644}

RPM_SCRIPTLETS = {
    "pre_install_script": "%pre", "post_install_script": "%post",
    "pre_uninstall_script": "%preun", "post_uninstall_script": "%postun",
    "pre_trans_script": "%pretrans", "post_trans_script": "%posttrans",
}
RPM_DEPENDENCY_TABLES = {
    "requires": "Requires", "obsoletes": "Obsoletes", "conflicts": "Conflicts",
    "provides": "Provides", "recommends": "Recommends", "supplements": "Supplements",
    "suggests": "Suggests", "enhances": "Enhances",
}
RPM_KEYS = {
    "name", "version", "license", "summary", "description", "url", "release", "epoch", "vendor",
    "assets", "auto-req", "require-sh", *RPM_SCRIPTLETS, *RPM_DEPENDENCY_TABLES,
}
RPM_ASSET_KEYS = {"source", "dest", "mode", "config", "doc", "user", "group", "caps"}


class PackagingError(Exception):
    pass


def log(msg):
    print(f"[packaging] {msg}", file=sys.stderr)


def run(cmd, **kwargs):
    """Runs a tool; its stdout goes to our stderr (our stdout carries only the package paths)."""
    log("$ " + " ".join(shlex.quote(str(c)) for c in cmd))
    result = subprocess.run([str(c) for c in cmd], stdout=sys.stderr, **kwargs)
    if result.returncode != 0:
        raise PackagingError(f"{cmd[0]} exited with {result.returncode}")


def need_tool(name, apt_package):
    if shutil.which(name) is None:
        raise PackagingError(f"{name} not found: apt-get install {apt_package}")


# --- Cargo.toml ------------------------------------------------------------------------------

class Manifest:
    def __init__(self, path, target_dir):
        self.path = Path(path).resolve()
        self.root = self.path.parent
        self.target_dir = Path(target_dir).resolve()
        with open(self.path, "rb") as f:
            self.doc = tomllib.load(f)
        self.package = self.doc.get("package")
        if not isinstance(self.package, dict):
            raise PackagingError(f"{self.path}: no [package]")
        self.metadata = self.package.get("metadata", {})

    def field(self, key, default=None):
        """A [package] field, following `key.workspace = true` into this file's [workspace]."""
        value = self.package.get(key, default)
        if isinstance(value, dict) and value.get("workspace") is True:
            try:
                value = self.doc["workspace"]["package"][key]
            except KeyError:
                raise PackagingError(f"{self.path}: {key}.workspace = true, but no "
                                     f"[workspace.package] {key} in this file") from None
        return value

    def source(self, rel):
        """An asset source: target/... is read from the real target dir, as the tools did."""
        if rel.startswith("target/"):
            return self.target_dir / rel[len("target/"):]
        return self.root / rel


def check_keys(table, allowed, where):
    unknown = sorted(set(table) - allowed)
    if unknown:
        hint = ""
        if "systemd-units" in unknown:
            hint = (" (write the systemd enable/start/stop snippets into the maintainer scripts, "
                    "and list the unit as an asset)")
        raise PackagingError(f"{where}: not implemented by scripts/packaging.py: "
                             f"{', '.join(unknown)}{hint}")


def parse_mode(value, source, where):
    if value is None:
        return os.stat(source).st_mode & 0o7777
    try:
        return int(str(value), 8)
    except ValueError:
        raise PackagingError(f"{where}: mode {value!r} is not octal") from None


def expand_assets(manifest, entries, allowed_keys, where):
    """[(source Path, dest without leading '/', entry)] with globs expanded (files only)."""
    out = []
    for i, entry in enumerate(entries):
        at = f"{where} assets[{i}]"
        if not isinstance(entry, dict):
            raise PackagingError(f"{at}: use the {{ source, dest, mode }} table form")
        check_keys(entry, allowed_keys, at)
        try:
            source, dest = entry["source"], entry["dest"]
        except KeyError as e:
            raise PackagingError(f"{at}: missing {e.args[0]}") from None
        src = manifest.source(source)
        if any(c in source for c in "*?["):
            matches = sorted(Path(p) for p in glob.glob(str(src)) if os.path.isfile(p))
            if not matches:
                raise PackagingError(f"{at}: {source} matches no file")
            if not dest.endswith("/"):
                raise PackagingError(f"{at}: a glob's dest must be a directory ending in /")
            pairs = [(m, dest + m.name) for m in matches]
        else:
            if not src.is_file():
                raise PackagingError(f"{at}: {src} not found"
                                     + (" (build it, or run without --no-build)"
                                        if source.startswith("target/") else ""))
            pairs = [(src, dest + src.name if dest.endswith("/") else dest)]
        for s, d in pairs:
            d = d.lstrip("/")
            if not d or d.endswith("/") or ".." in Path(d).parts:
                raise PackagingError(f"{at}: bad dest {d!r}")
            out.append((s, d, entry))
    seen, unique = set(), []
    for s, d, e in out:
        if d in seen:  # cargo-deb: "first one wins"
            log(f"warning: {where}: duplicate asset for /{d}; the first one is kept")
            continue
        seen.add(d)
        unique.append((s, d, e))
    return unique


def is_elf(path):
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def host_arch():
    machine = platform.machine()
    if machine not in ARCHES:
        raise PackagingError(f"unsupported architecture {machine}")
    return ARCHES[machine]


# --- deb -------------------------------------------------------------------------------------

def split_by_chars(text, length=79):
    """cargo-deb's control-field wrapping (util/wordsplit.rs): words joined up to `length`,
    a blank line becomes '.'."""
    lines = []
    src = text.split("\n")
    if src and src[-1] == "":
        src.pop()
    for line in src:
        line = line.removesuffix("\r")
        if line.strip() == "":
            lines.append(".")
            continue
        line = line.replace("\t", "  ")
        current, has_words = "", False
        for word in line.split(" "):
            if current.strip() == "":
                current += (" " if has_words else "") + word
                has_words = True
                continue
            if len(current.encode()) + len(word.encode()) >= length:
                lines.append(current)
                current = word
            else:
                current += " " + word
        lines.append("." if current.strip() == "" else current)
    return lines


def deb_version(version, revision):
    upstream = version.replace("-", "~", 1) if "-" in version.split("+", 1)[0] else version
    return f"{upstream}-{revision}" if revision else upstream


def shlib_depends(binary, arch):
    """cargo-deb's $auto: dpkg-shlibdeps -xlibgcc -O, libgcc dropped (always present)."""
    with tempfile.TemporaryDirectory() as work:
        os.mkdir(os.path.join(work, "debian"))
        open(os.path.join(work, "debian", "control"), "w").close()
        result = subprocess.run(
            ["dpkg-shlibdeps", "-xlibgcc", "-O", str(binary)], cwd=work, capture_output=True,
            text=True, env={**os.environ, "DEB_HOST_ARCH": arch})
    # (cargo-deb ran it on the built binary too, and kept this warning to itself.)
    sys.stderr.writelines(line for line in result.stderr.splitlines(keepends=True)
                          if "should already be installed in their package's directory" not in line)
    if result.returncode != 0:
        raise PackagingError(f"dpkg-shlibdeps {binary} exited with {result.returncode}")
    for line in result.stdout.splitlines():
        if line.startswith("shlibs:Depends="):
            deps = [d.strip() for d in line[len("shlibs:Depends="):].split(",")]
            return [d for d in deps if d and not d.startswith(("libgcc-", "libgcc1"))]
    log(f"warning: dpkg-shlibdeps found no shared library dependency of {binary}")
    return []


def arch_allows(spec, arch):
    """A `dep [amd64 !arm64]` architecture restriction."""
    wanted = spec.split()
    negated = [a[1:] for a in wanted if a.startswith("!")]
    if negated:
        return arch not in negated
    return arch in wanted


def resolve_depends(spec, elf_sources, arch):
    deps = set()
    for word in spec.split(","):
        word = word.strip()
        if not word:
            continue
        if word == "$auto":
            for binary in elf_sources:
                deps.update(shlib_depends(binary, arch))
            continue
        m = re.fullmatch(r"(.*?)\s*\[([^\]]*)\]", word)
        if m:
            if arch_allows(m.group(2), arch):
                deps.add(m.group(1))
        else:
            deps.add(word)
    return ", ".join(sorted(deps))


def source_date_epoch(manifest):
    env = os.environ.get("SOURCE_DATE_EPOCH")
    if env:
        return int(env)
    mtime = int(manifest.path.stat().st_mtime)
    return mtime - mtime % (24 * 3600)


def build_deb(manifest, out_dir):
    meta = manifest.metadata.get("deb")
    if not isinstance(meta, dict):
        raise PackagingError(f"{manifest.path}: no [package.metadata.deb]")
    check_keys(meta, DEB_KEYS, "[package.metadata.deb]")
    need_tool("dpkg-deb", "dpkg")
    crate_name = manifest.package["name"]
    name = meta.get("name", crate_name)
    version = deb_version(manifest.field("version"), str(meta.get("revision", "1")))
    arch = host_arch()[0]
    authors = manifest.field("authors", [])
    maintainer = meta.get("maintainer") or (authors[0] if authors else None)
    if not maintainer:
        raise PackagingError("[package.metadata.deb]: no maintainer (and no package.authors)")
    description = manifest.field("description")
    if not description:
        raise PackagingError("[package]: no description")
    extended = meta.get("extended-description")
    if extended is None and "extended-description-file" in meta:
        extended = (manifest.root / meta["extended-description-file"]).read_text()

    assets = [(s, d, parse_mode(e.get("mode"), s, "[package.metadata.deb]"))
              for s, d, e in expand_assets(manifest, meta.get("assets", []), DEB_ASSET_KEYS,
                                           "[package.metadata.deb]")]
    generated = {}
    copyright_path = f"usr/share/doc/{name}/copyright"
    if all(d != copyright_path for _, d, _ in assets):
        text = "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
        text += f"Upstream-Name: {crate_name}\n"
        source_url = manifest.field("repository") or manifest.field("homepage")
        if source_url:
            text += f"Source: {source_url}\n"
        owner = meta.get("copyright") or (", ".join(authors) if authors else None)
        if owner:
            text += f"Copyright: {owner}\n"
        else:
            text += f"Comment: Copyright information missing (maintainer: {maintainer})\n"
        if manifest.field("license"):
            text += f"License: {manifest.field('license')}\n"
        generated[copyright_path] = text.encode()

    conffiles = []
    for _, d, _ in assets:
        if d.startswith("etc/"):
            conffiles.append("/" + d)
    for extra in meta.get("conf-files", []):
        extra = "/" + extra.lstrip("/")
        if extra not in conffiles:
            conffiles.append(extra)

    scripts = {}
    if "maintainer-scripts" in meta:
        scripts_dir = manifest.root / meta["maintainer-scripts"]
        if not scripts_dir.is_dir():
            raise PackagingError(f"maintainer-scripts: {scripts_dir} is not a directory")
        for script in DEB_SCRIPTS:
            path = scripts_dir / script
            if path.is_file():
                text = path.read_bytes()
                if b"#DEBHELPER#" in text:
                    raise PackagingError(f"{path}: #DEBHELPER# is not filled in by "
                                         "scripts/packaging.py; write the snippet out")
                scripts[script] = text

    depends_spec = meta.get("depends", "$auto")
    if "$auto" in depends_spec:
        need_tool("dpkg-shlibdeps", "dpkg-dev")
    elf_sources = [s for s, _, mode in assets if mode & 0o111 and is_elf(s)]
    depends = resolve_depends(depends_spec, elf_sources, arch)
    log(f"deb Depends: {depends or '(none)'}")

    installed_size = sum((s.stat().st_size + 2047) // 1024 for s, _, _ in assets)
    installed_size += sum((len(data) + 2047) // 1024 for data in generated.values())

    control = [f"Package: {name}", f"Version: {version}", f"Architecture: {arch}"]
    homepage = (manifest.field("homepage") or manifest.field("documentation")
                or manifest.field("repository"))
    if homepage:
        control.append(f"Homepage: {homepage}")
    if meta.get("section"):
        control.append(f"Section: {meta['section']}")
    control.append(f"Priority: {meta.get('priority', 'optional')}")
    control.append(f"Maintainer: {maintainer}")
    control.append(f"Installed-Size: {installed_size}")
    if depends:
        control.append(f"Depends: {depends}")
    for key, field in DEB_RELATION_FIELDS:
        if meta.get(key, "").strip():
            control.append(f"{field}: {meta[key].strip()}")
    desc_lines = split_by_chars(description)
    if extended:
        desc_lines += split_by_chars(extended)
    control.append("Description: " + desc_lines[0])
    control += [" " + line for line in desc_lines[1:]]

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}_{version}_{arch}.deb"
    epoch = source_date_epoch(manifest)
    stage = Path(tempfile.mkdtemp(prefix=".deb-staging-", dir=out_dir))
    try:
        stage.chmod(0o755)

        def put(dest, data=None, source=None, mode=0o644):
            path = stage / dest
            for parent in reversed(path.relative_to(stage).parents[:-1]):
                d = stage / parent
                if not d.is_dir():
                    d.mkdir()
                    d.chmod(0o755)
            if source is not None:
                shutil.copyfile(source, path)
            else:
                path.write_bytes(data)
            path.chmod(mode)

        for source, dest, mode in assets:
            put(dest, source=source, mode=mode)
        for dest, data in generated.items():
            put(dest, data=data)

        md5sums = []
        for dest in sorted([d for _, d, _ in assets] + list(generated)):
            if "/" + dest in conffiles:
                continue
            digest = hashlib.md5()
            with open(stage / dest, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            md5sums.append(f"{digest.hexdigest()}  {dest}\n")

        put("DEBIAN/control", "\n".join(control).encode() + b"\n")
        if conffiles:
            put("DEBIAN/conffiles", "".join(c + "\n" for c in conffiles).encode())
        put("DEBIAN/md5sums", "".join(md5sums).encode())
        for script, text in scripts.items():
            put(f"DEBIAN/{script}", text, mode=DEB_SCRIPTS[script])

        for dirpath, dirnames, filenames in os.walk(stage, topdown=False):
            for entry in filenames + dirnames:
                os.utime(os.path.join(dirpath, entry), (epoch, epoch), follow_symlinks=False)
        os.utime(stage, (epoch, epoch))

        out.unlink(missing_ok=True)
        run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", stage, out],
            env={**os.environ, "SOURCE_DATE_EPOCH": str(epoch)})
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


# --- RPM -------------------------------------------------------------------------------------

def spec_text(value):
    """Text placed in a spec: % is a macro there."""
    return str(value).replace("%", "%%")


def spec_path(path, where):
    if re.search(r'[\s"\\*?\[\]{}%]', path):
        raise PackagingError(f"{where}: {path!r}: spaces, quotes, glob and macro characters "
                             "are not supported in packaged paths")
    return path


def rpm_dependencies(table, field, where):
    lines = []
    for dep, spec in table.items():
        spec = str(spec).strip()
        if spec == "*":
            lines.append(f"{field}: {dep}")
            continue
        for part in spec.split(","):
            m = re.fullmatch(r"\s*(<=|>=|<|>|=)\s+(\S+)\s*", part)
            if not m:
                raise PackagingError(f"{where}: {dep} = {spec!r}: use \"*\" or \"OP VERSION\"")
            lines.append(f"{field}: {dep} {m.group(1)} {m.group(2)}")
    return lines


def build_rpm(manifest, out_dir):
    meta = manifest.metadata.get("generate-rpm")
    if not isinstance(meta, dict):
        raise PackagingError(f"{manifest.path}: no [package.metadata.generate-rpm]")
    where = "[package.metadata.generate-rpm]"
    check_keys(meta, RPM_KEYS, where)
    need_tool("rpmbuild", "rpm")
    name = meta.get("name", manifest.package["name"])
    version = str(meta.get("version", manifest.field("version"))).replace("-", "~")
    release = str(meta.get("release", "1"))
    license_ = meta.get("license", manifest.field("license"))
    summary = meta.get("summary") or meta.get("description") or manifest.field("description")
    if not license_ or not summary:
        raise PackagingError(f"{where}: no license or summary (nor package.license/description)")
    description = meta.get("description") or manifest.field("description") or summary
    url = meta.get("url") or manifest.field("homepage") or manifest.field("repository")
    arch = host_arch()[1]

    assets = expand_assets(manifest, meta.get("assets", []), RPM_ASSET_KEYS, where)

    spec = [
        "# Written by scripts/packaging.py from Cargo.toml's [package.metadata.generate-rpm].",
        "# The files ship as they are: no strip, no compression, no debuginfo, no build-id links.",
        "%global debug_package %{nil}",
        "%global __os_install_post %{nil}",
        "%global __arch_install_post %{nil}",
        "%global _build_id_links none",
        "%define _binary_payload w19.zstdio",
        f"Name: {spec_text(name)}",
        f"Version: {spec_text(version)}",
        f"Release: {spec_text(release)}",
    ]
    if "epoch" in meta:
        spec.append(f"Epoch: {int(meta['epoch'])}")
    spec += [f"Summary: {spec_text(summary)}", f"License: {spec_text(license_)}"]
    if meta.get("vendor"):
        spec.append(f"Vendor: {spec_text(meta['vendor'])}")
    if url:
        spec.append(f"URL: {spec_text(url)}")
    if meta.get("require-sh", True):
        spec.append("Requires: /bin/sh")
    for key, field in RPM_DEPENDENCY_TABLES.items():
        spec += [spec_text(line) for line in
                 rpm_dependencies(meta.get(key, {}), field, f"{where}.{key}")]
    if str(meta.get("auto-req", "auto")) in ("no", "disabled"):
        spec.append("AutoReq: no")
    spec += ["", "%description", spec_text(description.strip()), "", "%install"]
    for source, dest, entry in assets:
        mode = parse_mode(entry.get("mode"), source, where)
        spec.append(f'install -p -D -m {mode:04o} {spec_text(shlex.quote(str(source)))} '
                    f'"%{{buildroot}}"{spec_text(shlex.quote("/" + dest))}')
    for key, section in RPM_SCRIPTLETS.items():
        if key in meta:
            value = meta[key]
            path = manifest.root / value
            text = path.read_text() if "\n" not in value and path.is_file() else value
            spec += ["", section, spec_text(text.rstrip("\n"))]
    spec += ["", "%files", "%defattr(-,root,root,-)"]
    for source, dest, entry in assets:
        mode = parse_mode(entry.get("mode"), source, where)
        attrs = []
        config = entry.get("config", False)
        if config == "noreplace":
            attrs.append("%config(noreplace)")
        elif config is True:
            attrs.append("%config")
        elif config is not False:
            raise PackagingError(f"{where}: {dest}: config = {config!r} (true or \"noreplace\")")
        if entry.get("doc", False):
            attrs.append("%doc")
        if entry.get("caps"):
            attrs.append(f"%caps({spec_text(entry['caps'])})")
        user = spec_text(entry.get("user", "root"))
        group = spec_text(entry.get("group", "root"))
        attrs.append(f"%attr({mode:04o},{user},{group})")
        spec.append(" ".join(attrs) + " " + spec_path("/" + dest, where))
    spec.append("")

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}-{version}-{release}.{arch}.rpm"
    top = Path(tempfile.mkdtemp(prefix=".rpmbuild-", dir=out_dir))
    try:
        for d in ("SPECS", "BUILD", "BUILDROOT", "tmp"):
            (top / d).mkdir()
        spec_file = top / "SPECS" / f"{name}.spec"
        spec_file.write_text("\n".join(spec))
        cmd = ["rpmbuild", "-bb", "--quiet", "--nodeps", "--target", arch,
               "--define", f"_topdir {top}", "--define", f"_tmppath {top / 'tmp'}",
               "--define", f"_rpmdir {out_dir}",
               "--define", "_build_name_fmt %%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm"]
        if os.environ.get("SOURCE_DATE_EPOCH"):
            cmd += ["--define", "use_source_date_epoch_as_buildtime 1",
                    "--define", "clamp_mtime_to_source_date_epoch 1"]
        out.unlink(missing_ok=True)
        run(cmd + [spec_file])
    finally:
        shutil.rmtree(top, ignore_errors=True)
    if not out.is_file():
        raise PackagingError(f"rpmbuild did not write {out}")
    return out


def main():
    parser = argparse.ArgumentParser(
        description="Build the deb and the RPM from Cargo.toml's [package.metadata.deb] and "
                    "[package.metadata.generate-rpm] with dpkg-deb and rpmbuild. Prints the "
                    "package paths on stdout.")
    parser.add_argument("what", nargs="?", choices=["all", "deb", "rpm"], default="all",
                        help="which packages (default: all, the deb first)")
    parser.add_argument("--manifest-path", default=str(ROOT / "Cargo.toml"),
                        help="the package's Cargo.toml (default: the repository's)")
    parser.add_argument("--target-dir",
                        default=os.environ.get("CARGO_TARGET_DIR") or str(ROOT / "target"),
                        help="Cargo's target dir: target/... asset sources are read from it and "
                             "the packages written under it (default: $CARGO_TARGET_DIR or "
                             "./target)")
    args = parser.parse_args()
    try:
        manifest = Manifest(args.manifest_path, args.target_dir)
        if args.what in ("all", "deb"):
            print(build_deb(manifest, manifest.target_dir / "debian"), flush=True)
        if args.what in ("all", "rpm"):
            print(build_rpm(manifest, manifest.target_dir / "generate-rpm"), flush=True)
    except (PackagingError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"[packaging] error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
