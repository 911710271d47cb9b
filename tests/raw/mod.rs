//! The redb database inside a closed store file, for tests that damage a file on purpose or
//! lay it out as an earlier release did. A store file is a 4 KiB header, the write-ahead log
//! (its length is in the header at bytes 22..30), then redb's file.

// Each including crate uses a different part of this module.
#![allow(dead_code)]

use std::os::unix::fs::FileExt;
use std::path::Path;

use redb::{ReadableDatabase, ReadableTable, TableDefinition};

/// Sequence number → the stored key's length (`u16`, big-endian), the stored key, the record.
pub const RECORDS: TableDefinition<u64, &[u8]> =
    TableDefinition::new("idempotency_records_by_number");
/// `(key hash, sequence number)` → `()`.
pub const KEYS: TableDefinition<(u64, u64), ()> = TableDefinition::new("idempotency_keys");
pub const META: TableDefinition<&str, u64> = TableDefinition::new("idempotency_meta");
pub const EXPIRY: TableDefinition<(u64, u64), ()> = TableDefinition::new("idempotency_expiry");
/// Formats 3 and 4: key hash (8 bytes, big-endian) + stored key → record bytes.
pub const HASHED: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idempotency_records");

/// A stored key's hash in the key index (the first 8 bytes of its BLAKE3 digest).
pub fn key_hash(stored: &[u8]) -> u64 {
    u64::from_be_bytes(
        blake3::hash(stored).as_bytes()[..8]
            .try_into()
            .expect("8 bytes"),
    )
}

/// A records-table value: `stored`'s length, `stored`, then the record's `bytes`.
pub fn entry(stored: &[u8], bytes: &[u8]) -> Vec<u8> {
    let len = u16::try_from(stored.len()).expect("a stored key is short");
    [&len.to_be_bytes()[..], stored, bytes].concat()
}

/// The stored key and the record bytes of a records-table value.
pub fn split(value: &[u8]) -> (&[u8], &[u8]) {
    let len = usize::from(u16::from_be_bytes([value[0], value[1]]));
    value[2..].split_at(len)
}

/// The number of `stored`'s record.
pub fn number_of(db: &redb::Database, stored: &[u8]) -> u64 {
    let txn = db.begin_read().expect("txn");
    let records = txn.open_table(RECORDS).expect("records");
    let found = records
        .iter()
        .expect("iter")
        .map(|e| e.expect("entry"))
        .find(|(_, entry)| split(entry.value()).0 == stored)
        .map(|(number, _)| number.value());
    found.expect("the key has a record")
}

/// The redb database inside the closed store file at `path`.
pub fn raw_redb(path: &Path) -> redb::Database {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    let mut header = [0u8; 30];
    file.read_exact_at(&mut header, 0).expect("header");
    let log_len = u64::from_le_bytes(header[22..30].try_into().expect("8 bytes"));
    redb::Builder::new()
        .create_with_backend(Inner {
            file,
            start: 4096 + log_len,
        })
        .expect("the redb inside the store")
}

/// Lays the closed store file at `path` out as format 3 did: its records filed under their
/// key's hash followed by the key, no key index.
pub fn downgrade_to_format_3(path: &Path) {
    let db = raw_redb(path);
    let txn = db.begin_write().expect("txn");
    {
        let records = txn.open_table(RECORDS).expect("records");
        let mut hashed = txn.open_table(HASHED).expect("hashed");
        for entry in records.iter().expect("iter") {
            let (_, entry) = entry.expect("entry");
            let (stored, bytes) = split(entry.value());
            let filed = [&key_hash(stored).to_be_bytes()[..], stored].concat();
            hashed.insert(filed.as_slice(), bytes).expect("insert");
        }
        txn.open_table(META)
            .expect("meta")
            .insert("format_version", 3)
            .expect("format");
    }
    assert!(txn.delete_table(RECORDS).expect("delete"));
    assert!(txn.delete_table(KEYS).expect("delete"));
    txn.commit().expect("commit");
}

/// The format version the closed store file at `path` holds.
pub fn format_version(path: &Path) -> u64 {
    let db = raw_redb(path);
    let txn = db.begin_read().expect("txn");
    let meta = txn.open_table(META).expect("meta");
    let version = meta.get("format_version").expect("get").expect("a version");
    version.value()
}

#[derive(Debug)]
struct Inner {
    file: std::fs::File,
    start: u64,
}

impl redb::StorageBackend for Inner {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.file.metadata()?.len() - self.start)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.file.read_exact_at(out, offset + self.start)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.file.set_len(len + self.start)
    }

    fn sync_data(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.file.write_all_at(data, offset + self.start)
    }
}

/// Adds to the closed format-3 file at `path` a record filed under a hash that is not its
/// key's, counted in the usage counters as the release that wrote it would have.
pub fn add_misfiled_format_3_record(path: &Path) {
    let db = raw_redb(path);
    let txn = db.begin_write().expect("txn");
    {
        let stored = b"\0misfiled";
        let filed = [&[0u8; 8][..], stored].concat();
        let bytes = b"a record no lookup reaches";
        let mut hashed = txn.open_table(HASHED).expect("hashed");
        hashed.insert(filed.as_slice(), &bytes[..]).expect("insert");
        let mut meta = txn.open_table(META).expect("meta");
        for (counter, more) in [
            ("record_count", 1),
            ("record_bytes", stored.len() + bytes.len()),
        ] {
            let now = meta.get(counter).expect("get").map_or(0, |v| v.value());
            meta.insert(counter, now + more as u64).expect("insert");
        }
    }
    txn.commit().expect("commit");
}
