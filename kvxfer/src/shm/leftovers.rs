//! Pool files a crashed decode node left behind.
//!
//! A region's file is `kvmesh-pool-<pid>-<32 hex>.shm`, created 0600 by the
//! decode process `<pid>` and unlinked when its region drops. A process
//! that dies without dropping it (killed, crashed) leaves the file in the
//! tmpfs: its pages hold tenants' KV, and a crash loop would fill the tmpfs.
//! Before creating a region, [`sweep`] removes the files of this naming
//! that this user owns and whose process is gone. Costs one directory scan
//! per decode start. A file whose pid now names an unrelated live process
//! is kept (no harm beyond the space; the next sweep after that process
//! ends removes it); files of other users and of other names are never
//! touched.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The file name of a region created by process `pid`.
pub(super) fn file_name(pid: u32, hex: &str) -> String {
    format!("kvmesh-pool-{pid}-{hex}.shm")
}

/// The pid in a pool file's name, if the name is one of ours.
fn pid_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("kvmesh-pool-")?.strip_suffix(".shm")?;
    let (pid, hex) = rest.split_once('-')?;
    (hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| pid.parse().ok())
        .flatten()
}

fn alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes this user's pool files in `dir` whose process is gone; returns
/// the paths removed. Errors reading the directory or removing a file are
/// skipped (the new region is created regardless).
pub(super) fn sweep(dir: &Path) -> Vec<PathBuf> {
    let Ok(me) = std::fs::metadata("/proc/self").map(|m| m.uid()) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(pid_of) else {
            continue;
        };
        let ours = entry.metadata().is_ok_and(|m| m.is_file() && m.uid() == me);
        if ours && !alive(pid) && std::fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid above any this kernel hands out: never alive.
    fn dead_pid() -> u32 {
        let max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(4_194_304);
        max + 1
    }

    #[test]
    fn names_parse_only_when_they_are_ours() {
        let hex = "0123456789abcdef0123456789abcdef";
        assert_eq!(pid_of(&file_name(42, hex)), Some(42));
        assert_eq!(pid_of("kvmesh-pool-42-short.shm"), None);
        assert_eq!(pid_of(&format!("kvmesh-pool-{hex}.shm")), None);
        assert_eq!(pid_of(&format!("other-42-{hex}.shm")), None);
    }

    /// A dead process's file goes; a live one's, another name, and a
    /// directory of our naming stay.
    #[test]
    fn sweep_removes_only_files_of_dead_processes() {
        let d = tempfile::tempdir().expect("tempdir");
        let hex = "00112233445566778899aabbccddeeff";
        let dead = d.path().join(file_name(dead_pid(), hex));
        let live = d.path().join(file_name(std::process::id(), hex));
        let other = d.path().join("kvmesh-notes.shm");
        for f in [&dead, &live, &other] {
            std::fs::write(f, b"kv").expect("write");
        }
        let dir_like = d.path().join(file_name(dead_pid() + 1, hex));
        std::fs::create_dir(&dir_like).expect("mkdir");
        assert_eq!(sweep(d.path()), vec![dead.clone()]);
        assert!(!dead.exists());
        assert!(live.exists() && other.exists() && dir_like.exists());
        assert!(sweep(d.path()).is_empty(), "nothing left to sweep");
    }
}
