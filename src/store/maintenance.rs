//! Whole-store checks and counts: `verify` and `stats`.

use redb::ReadableTable;

use crate::api::key::Key;
use crate::api::outcome::RecordState;
use crate::api::record::{Record, State};
use crate::api::report::{Stats, VerifyReport};
use crate::engine::contain::contain;
use crate::engine::tables::{self, EXPIRY, RECORDS, RecordsRead};
use crate::error::Result;
use crate::store::Store;

impl Store {
    /// Walks the tables and checks the invariants: every record decodes, has a valid key, its
    /// entry in the key index and exactly one expiry entry at its `expires_at`, and holds a
    /// token below the token counter; every key-index entry names a record with its hash, and
    /// every expiry entry belongs to a record. Takes a read snapshot; writers go on.
    ///
    /// # Errors
    /// [`Error::Storage`](crate::Error::Storage) if the file cannot be read. Damaged records
    /// are reported as problems, not errors.
    pub(crate) fn check_tables(&self) -> Result<VerifyReport> {
        contain("verifying", || self.walk())
    }

    fn walk(&self) -> Result<VerifyReport> {
        // The counters live in memory between merges and the latest changes in the
        // overlay; under the writer lock, the flushed tables and the counters agree exactly.
        let (txn, counters) = self.engine.snapshot()?;
        let records = RecordsRead::open(&txn)?;
        let expiry = txn.open_table(EXPIRY)?;
        let next_token = counters.next_token;
        let counted = (counters.usage.records, counters.usage.bytes);
        let mut actual = (0u64, 0u64);
        let mut report = VerifyReport::default();
        for entry in records.records().iter()? {
            let (number, entry) = entry?;
            let number = number.value();
            report.records += 1;
            let (key, value) = match tables::split(number, entry.value()) {
                Ok(parts) => parts,
                Err(err) => {
                    report.problems.push(err.to_string());
                    continue;
                }
            };
            actual.0 += 1;
            actual.1 += (key.len() + value.len()) as u64;
            check_filing(&records, number, key, &mut report)?;
            let name = match Key::from_stored(key) {
                Ok(parsed) => parsed.to_string(),
                Err(e) => {
                    let name = String::from_utf8_lossy(key).into_owned();
                    report.problems.push(format!("record {name:?}: {e}"));
                    name
                }
            };
            let record = match Record::decode(key, value) {
                Ok(record) => record,
                Err(e) => {
                    report.problems.push(format!("record {name:?}: {e}"));
                    continue;
                }
            };
            if expiry
                .get((record.expires_at, tables::key_hash(key)))?
                .is_none()
            {
                report.problems.push(format!(
                    "record {name:?} has no expiry entry at {}",
                    record.expires_at
                ));
            }
            if let State::InProgress { token, .. } = record.state
                && token >= next_token
            {
                report.problems.push(format!(
                    "record {name:?} holds token {token}, not below the counter {next_token}"
                ));
            }
        }
        if actual != counted {
            report.problems.push(format!(
                "usage counters say {counted:?} (records, bytes) but the table holds {actual:?}"
            ));
        }
        check_key_index(&records, &mut report)?;
        for entry in expiry.iter()? {
            let (expires_at, hash) = entry?.0.value();
            report.expiry_entries += 1;
            // An undecodable owner was reported by the record walk already.
            let matches = records.under_hash(hash)?.iter().any(|(key, value)| {
                Record::decode(key, value).map_or(true, |r| r.expires_at == expires_at)
            });
            if !matches {
                report.problems.push(format!(
                    "expiry entry ({expires_at}, key hash {hash:016x}) has no record expiring \
                     then"
                ));
            }
        }
        Ok(report)
    }

    /// Counts records by state (a full scan) and reports the file size.
    ///
    /// # Errors
    /// [`Error::Storage`](crate::Error::Storage) or [`Error::Corrupted`](crate::Error::Corrupted)
    /// if a record cannot be read.
    pub(crate) fn count_records(&self) -> Result<Stats> {
        contain("counting records", || self.count())
    }

    fn count(&self) -> Result<Stats> {
        let now = self.engine.now();
        let (txn, _) = self.engine.snapshot()?;
        let records = txn.open_table(RECORDS)?;
        let mut stats = Stats {
            file_bytes: self
                .path()
                .and_then(|p| std::fs::metadata(p).ok())
                .map(|m| m.len()),
            ..Stats::default()
        };
        for entry in records.iter()? {
            let (number, entry) = entry?;
            let (key, value) = tables::split(number.value(), entry.value())?;
            let record = Record::decode(key, value)?;
            if record.is_expired(now) {
                stats.expired += 1;
                continue;
            }
            let view = record.into_view();
            match view.state {
                RecordState::InProgress { .. } => {
                    stats.in_progress += 1;
                    stats.stuck += u64::from(view.is_stuck(now));
                }
                RecordState::Completed { .. } => stats.completed += 1,
            }
        }
        Ok(stats)
    }
}

/// Reports key-index entries that name no record, or a record whose key has another hash.
fn check_key_index(records: &RecordsRead, report: &mut VerifyReport) -> Result<()> {
    for entry in records.keys().iter()? {
        let (hash, number) = entry?.0.value();
        let filed = records.records().get(number)?;
        let key = filed.as_ref().map(|e| tables::split(number, e.value()));
        if !matches!(key, Some(Ok((key, _))) if tables::key_hash(key) == hash) {
            report.problems.push(format!(
                "key index entry (hash {hash:016x}, record {number}) names no record with that \
                 hash"
            ));
        }
    }
    Ok(())
}

/// Reports a record that the key index does not name, or whose key an earlier record has too
/// (lookups find only the first).
fn check_filing(
    records: &RecordsRead,
    number: u64,
    key: &[u8],
    report: &mut VerifyReport,
) -> Result<()> {
    let name = String::from_utf8_lossy(key);
    if records
        .keys()
        .get((tables::key_hash(key), number))?
        .is_none()
    {
        report.problems.push(format!(
            "record {number} ({name:?}) has no entry in the key index"
        ));
        return Ok(());
    }
    match records.number(key) {
        Ok(Some(first)) if first != number => report.problems.push(format!(
            "record {number} ({name:?}) has the key of record {first} too; lookups find only \
             record {first}"
        )),
        Ok(_) => {}
        Err(err) => report
            .problems
            .push(format!("record {number} ({name:?}): {err}")),
    }
    Ok(())
}
