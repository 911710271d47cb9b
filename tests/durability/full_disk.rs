//! A disk that fills up (an edge device's usual death): the failing call returns an error,
//! never a panic; after space is freed and the store reopened, nothing acknowledged is lost,
//! `verify()` is clean and the store takes new claims.
//!
//! Mounts a small tmpfs, so it needs root; where mounting is not permitted it prints why and
//! skips.

use std::path::Path;
use std::process::Command;

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Error, Fingerprint, Key, Response, Result, Store};

struct Mount<'a>(&'a Path);

impl Drop for Mount<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0).status();
    }
}

fn mount_tmpfs<'a>(dir: &'a Path, size: &str) -> std::result::Result<Mount<'a>, String> {
    let out = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(dir)
        .output()
        .map_err(|e| format!("cannot run mount: {e}"))?;
    if out.status.success() {
        Ok(Mount(dir))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

#[test]
fn a_full_disk_fails_calls_cleanly_and_loses_nothing_acknowledged() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let _mount = match mount_tmpfs(dir.path(), "8m") {
        Ok(mount) => mount,
        Err(why) if std::env::var_os("CI").is_some() && cfg!(target_os = "linux") => {
            panic!("CI runs as root and must be able to mount a tmpfs: {why}")
        }
        Err(why) => {
            println!("SKIPPED: cannot mount a tmpfs for the full-disk test ({why})");
            return Ok(());
        }
    };
    let path = dir.path().join("full.redb");
    let body = vec![0xabu8; 16 * 1024];
    let mut acknowledged = Vec::new();
    let first_error = {
        let store = Store::open(&path)?;
        let mut i = 0;
        loop {
            let key = Key::new(&format!("k{i}"))?;
            let f = Fingerprint::of([key.key()]);
            let lease = match store.claim(&key, f) {
                Ok(Claim::Acquired(lease)) => lease,
                Ok(other) => panic!("fresh key answered {other:?}"),
                Err(err) => break err,
            };
            if let Err(err) = store.complete(&lease, Response::new(200, body.clone())) {
                break err;
            }
            acknowledged.push(key);
            i += 1;
            assert!(i < 100_000, "the 8 MiB disk never filled up");
        }
    };
    println!(
        "disk full after {} acknowledged completions: {first_error}",
        acknowledged.len()
    );
    assert!(
        matches!(first_error, Error::Storage { .. }),
        "{first_error:?}"
    );
    assert!(
        acknowledged.len() > 10,
        "the disk filled too early to prove anything"
    );

    // Free space: grow the tmpfs (as an operator would clear other files), then reopen.
    let status = Command::new("mount")
        .args(["-o", "remount,size=64m"])
        .arg(dir.path())
        .status()
        .expect("remount");
    assert!(status.success(), "remount failed");
    let store = Store::open(&path)?;
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    for key in &acknowledged {
        let f = Fingerprint::of([key.key()]);
        match store.claim(key, f)? {
            Claim::Completed(replay) => assert_eq!(replay.response.body, body, "{key} altered"),
            other => panic!("{key}: acknowledged completion lost: {other:?}"),
        }
    }
    let Claim::Acquired(lease) = store.claim(&Key::new("after")?, Fingerprint::of(["after"]))?
    else {
        panic!("no new claim after space was freed");
    };
    store.complete(&lease, Response::new(200, "ok"))?;
    println!(
        "after freeing space: {} keys replayed intact, new claims work",
        acknowledged.len()
    );
    Ok(())
}
