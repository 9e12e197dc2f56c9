//! The fixtures' tables (tests/fixtures/gpus/expected.tsv, tests/fixtures/driver-lines.tsv):
//! tab-separated, `#` comment lines, the first other line naming the columns. Here, not in the
//! test kit, because the fake's own tests read them too and the kit depends on this crate.

use std::collections::BTreeMap;
use std::path::Path;

/// A table's rows, each by column name; an error names the file and the line of a row whose
/// width is not the header's.
pub fn tsv(path: &Path) -> Result<Vec<BTreeMap<String, String>>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.starts_with('#') && !l.trim().is_empty());
    let (_, header) = lines
        .next()
        .ok_or_else(|| format!("{}: no header row", path.display()))?;
    let header: Vec<&str> = header.split('\t').collect();
    lines
        .map(|(i, l)| {
            let cells: Vec<&str> = l.split('\t').collect();
            if cells.len() != header.len() {
                return Err(format!(
                    "{}:{}: {} cells, the header names {}",
                    path.display(),
                    i + 1,
                    cells.len(),
                    header.len()
                ));
            }
            Ok(header
                .iter()
                .zip(cells)
                .map(|(h, c)| (h.to_string(), c.to_string()))
                .collect())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rows_by_column_and_refuses_a_ragged_row() {
        let dir = std::env::temp_dir().join(format!("fake-nvml-tsv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.tsv");
        std::fs::write(&p, "# a comment\na\tb\n1\t2\n\n3\t4\n").unwrap();
        let rows = tsv(&p).unwrap();
        assert_eq!((rows[0]["a"].as_str(), rows[1]["b"].as_str()), ("1", "4"));
        std::fs::write(&p, "a\tb\n1\n").unwrap();
        assert!(tsv(&p).unwrap_err().contains("t.tsv:2"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
