//! A shared library's dynamic symbol table, read from its file, and a copy of a library with
//! some of its symbols taken out of that table.
//!
//! Why: an older driver's `libnvidia-ml.so.1` lacks the newer versioned entry points
//! (`nvmlDeviceGetGpuFabricInfoV` is not in R535's), and nvml-wrapper finds that out through
//! `dlsym`. [`without_symbols`] makes such a library out of the fake one (each named entry turned
//! undefined: `dlsym` fails, `nm -D` shows `U`), and [`dynamic_symbols`] lists what a real
//! library defines (tests/real_nvml.rs). ELF64 little-endian only (x86-64, aarch64), read from
//! the section headers; a file that is not one is an error, never a panic.

use std::path::Path;

/// One entry of the dynamic symbol table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynSymbol {
    pub name: String,
    /// Defined in this library (not `SHN_UNDEF`).
    pub defined: bool,
}

const SHT_RELA: u32 = 4;
const SHT_DYNSYM: u32 = 11;
const SYM_SIZE: usize = 24;
const RELA_SIZE: usize = 24;

fn bytes<const N: usize>(b: &[u8], at: usize) -> Result<[u8; N], String> {
    b.get(at..at.saturating_add(N))
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| format!("truncated ELF: {N} bytes at {at:#x}"))
}

fn u16_at(b: &[u8], at: usize) -> Result<u16, String> {
    bytes(b, at).map(u16::from_le_bytes)
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, String> {
    bytes(b, at).map(u32::from_le_bytes)
}

fn u64_at(b: &[u8], at: usize) -> Result<usize, String> {
    let v = bytes(b, at).map(u64::from_le_bytes)?;
    usize::try_from(v).map_err(|_| format!("ELF offset {v:#x} too large"))
}

/// A section header's (type, file offset, size, link).
struct Section {
    kind: u32,
    offset: usize,
    size: usize,
    link: usize,
}

fn sections(b: &[u8]) -> Result<Vec<Section>, String> {
    if b.get(..4) != Some(b"\x7fELF".as_slice()) || b.get(4) != Some(&2) || b.get(5) != Some(&1) {
        return Err("not an ELF64 little-endian file".into());
    }
    let shoff = u64_at(b, 0x28)?;
    let entsize = usize::from(u16_at(b, 0x3a)?);
    let count = usize::from(u16_at(b, 0x3c)?);
    (0..count)
        .map(|i| {
            let h = shoff + i * entsize;
            Ok(Section {
                kind: u32_at(b, h + 4)?,
                offset: u64_at(b, h + 24)?,
                size: u64_at(b, h + 32)?,
                link: u32_at(b, h + 40)? as usize,
            })
        })
        .collect()
}

/// The dynamic symbol table: its section and (name, defined, file offset of the entry) for each
/// entry after the null one.
fn dynsym(b: &[u8]) -> Result<(usize, Vec<(DynSymbol, usize)>), String> {
    let secs = sections(b)?;
    let (index, table) = secs
        .iter()
        .enumerate()
        .find(|(_, s)| s.kind == SHT_DYNSYM)
        .ok_or("no dynamic symbol table")?;
    let strings = secs.get(table.link).ok_or("dynsym links no string table")?;
    let mut out = Vec::new();
    for k in 1..table.size / SYM_SIZE {
        let e = table.offset + k * SYM_SIZE;
        let start = strings.offset + u32_at(b, e)? as usize;
        let len = b
            .get(start..)
            .and_then(|s| s.iter().position(|&c| c == 0))
            .ok_or("unterminated symbol name")?;
        let name = String::from_utf8_lossy(&b[start..start + len]).into_owned();
        let defined = u16_at(b, e + 6)? != 0;
        out.push((DynSymbol { name, defined }, e));
    }
    Ok((index, out))
}

/// The symbols of `path`'s dynamic symbol table.
pub fn dynamic_symbols(path: &Path) -> Result<Vec<DynSymbol>, String> {
    let b = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (_, syms) = dynsym(&b).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(syms.into_iter().map(|(s, _)| s).collect())
}

/// Writes to `dst` a copy of the library `src` in which each of `names` is no longer defined:
/// its dynamic symbol entry becomes undefined (section index, value and size 0), so the
/// dynamic linker finds no such symbol in it. Refused for a name `src` does not define, and for
/// one a relocation of `src` refers to (the library would no longer load).
pub fn without_symbols(src: &Path, dst: &Path, names: &[&str]) -> Result<(), String> {
    let mut b = std::fs::read(src).map_err(|e| format!("{}: {e}", src.display()))?;
    let (index, syms) = dynsym(&b)?;
    let mut bound = Vec::new();
    for s in sections(&b)?
        .iter()
        .filter(|s| s.kind == SHT_RELA && s.link == index)
    {
        for r in 0..s.size / RELA_SIZE {
            bound.push(u64_at(&b, s.offset + r * RELA_SIZE + 8)? >> 32);
        }
    }
    for name in names {
        let (k, (_, entry)) = syms
            .iter()
            .enumerate()
            .find(|(_, (s, _))| s.defined && s.name == *name)
            .ok_or_else(|| format!("{} defines no {name}", src.display()))?;
        if bound.contains(&(k + 1)) {
            return Err(format!(
                "{} binds {name} through a relocation of its own: without it, it would not load",
                src.display()
            ));
        }
        b[entry + 6..entry + 8].copy_from_slice(&0u16.to_le_bytes());
        b[entry + 8..entry + 24].copy_from_slice(&[0; 16]);
    }
    std::fs::write(dst, b).map_err(|e| format!("{}: {e}", dst.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_symbol_taken_out_is_undefined_and_the_rest_stay() {
        let fake = crate::fake_nvml();
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("libnvidia-ml.so.1");
        without_symbols(&fake, &copy, &["nvmlDeviceGetMemoryInfo_v2"]).unwrap();
        let before = dynamic_symbols(&fake).unwrap();
        let after = dynamic_symbols(&copy).unwrap();
        assert_eq!(before.len(), after.len());
        for (a, b) in before.iter().zip(&after) {
            let gone = a.name == "nvmlDeviceGetMemoryInfo_v2";
            assert_eq!((a.defined && !gone), b.defined, "{}", a.name);
        }
        // The legacy entry point calls its _v2 through a relocation: refused.
        let why = without_symbols(&fake, &copy, &["nvmlDeviceGetCount_v2"]).unwrap_err();
        assert!(why.contains("relocation"), "{why}");
        assert!(without_symbols(&fake, &copy, &["nvmlNoSuchThing"]).is_err());
        assert!(dynamic_symbols(Path::new("/proc/self/status")).is_err());
    }
}
