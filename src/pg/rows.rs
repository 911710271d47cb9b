//! Rows to records, and PostgreSQL errors to the crate's: the column decoders, a record's
//! decoding, `verify`'s checks of one row, and what a failed statement means for the caller.

use ::postgres::Row;
use ::postgres::types::FromSql;

use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::record::{Record, State};
use crate::api::response::Response;
use crate::error::{Error, Result};

/// A failed statement as an error. An `ERROR` the server answered for the statement means it
/// was rolled back (every call is one statement or one transaction): nothing was applied,
/// unless its code says the server lost touch with where the write ran ([`rolled_back`]).
/// Anything else (the connection lost, a `FATAL` from a terminated backend) may have come after
/// the statement committed: the sync client reports a connection's `FATAL` even when the
/// statement's success had already arrived, so the outcome is unknown.
pub(super) fn pg(context: &'static str, err: ::postgres::Error) -> Error {
    // What a store that prepares its statements meets behind a transaction pooler, where each
    // transaction may run on another server connection: say what to change.
    let context = match err.code() {
        Some(&::postgres::error::SqlState::INVALID_SQL_STATEMENT_NAME)
        | Some(&::postgres::error::SqlState::DUPLICATE_PSTATEMENT) => {
            "running a prepared statement on a server connection that lacks it or has another \
             of its name; behind a transaction-pooling proxy (PgBouncer pool_mode = \
             transaction) set the proxy's max_prepared_statements (PgBouncer 1.21 or later) \
             or connect with prepare_statements=false"
        }
        _ => context,
    };
    let applied_nothing = err.as_db_error().is_some_and(|db| {
        db.parsed_severity() == Some(::postgres::error::Severity::Error)
            && rolled_back(db.code().code())
    });
    if applied_nothing {
        Error::not_applied(context, err)
    } else {
        Error::storage(context, err)
    }
}

/// Whether an `ERROR` with SQLSTATE `code` proves the statement did nothing. One server rolls
/// back whatever it answers `ERROR` to, but a Citus coordinator answers `ERROR` also when it
/// lost a worker while the worker ran or committed the write: "could not commit transaction for
/// shard …" (`XX000`, after a commit whose reply never came), a lost connection (`08006`), or
/// the worker's own shutdown or I/O error passed on (`57P01`, `58030`). The write may have
/// committed on the worker, so these classes (connection exception, operator intervention,
/// system error, internal error) leave the outcome unknown. On one server that costs at most a
/// retry that finds the call's own result, where a wrong "did nothing" would hide a write.
fn rolled_back(code: &str) -> bool {
    !matches!(code.get(..2), Some("08" | "57" | "58" | "XX"))
}

pub(super) fn parts(key: &Key) -> (&str, &str) {
    (key.scope().unwrap_or(""), key.key())
}

pub(super) fn capped(value: u64, max: u64) -> i64 {
    i64::try_from(value.min(max)).unwrap_or(i64::MAX)
}

pub(super) fn token_param(token: u64) -> Result<i64> {
    // Tokens come from a bigint sequence; a larger one cannot hold any record.
    i64::try_from(token).map_err(|_| Error::LeaseLost)
}

pub(super) fn col<'a, T: FromSql<'a>>(row: &'a Row, idx: usize) -> Result<T> {
    row.try_get(idx)
        .map_err(|e| pg("reading a PostgreSQL row", e))
}

pub(super) fn millis_col(row: &Row, idx: usize) -> Result<u64> {
    let v: i64 = col(row, idx)?;
    u64::try_from(v).map_err(|_| Error::corrupted(format!("negative time {v} in a record")))
}

pub(super) fn token_col(row: &Row, idx: usize) -> Result<u64> {
    let v: i64 = col(row, idx)?;
    u64::try_from(v).map_err(|_| Error::corrupted(format!("negative token {v} in a record")))
}

pub(super) fn attempt_col(row: &Row, idx: usize) -> Result<u32> {
    let v: i64 = col(row, idx)?;
    u32::try_from(v).map_err(|_| Error::corrupted(format!("attempt {v} out of range")))
}

pub(super) fn bad_count(_: std::num::TryFromIntError) -> Error {
    Error::corrupted("a negative count from the server")
}

fn decode_headers(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
    let (headers, rest): (Vec<(String, Vec<u8>)>, _) = postcard::take_from_bytes(bytes)
        .map_err(|e| Error::corrupted(format!("response headers do not decode: {e}")))?;
    if !rest.is_empty() {
        return Err(Error::corrupted(format!(
            "response headers have {} trailing bytes",
            rest.len()
        )));
    }
    Ok(headers)
}

/// The columns a record is read from, after `c.now`.
pub(super) const RECORD_COLUMNS: &str = "r.fingerprint, r.fingerprint_version, r.state, r.token, \
     r.attempt, r.lease_until, r.checkpoint, r.response_status, r.response_headers, \
     r.response_body, r.created_at, r.completed_at, r.expires_at, r.claim_id";

/// Where each of [`RECORD_COLUMNS`] is, from the first one (`at` in [`record_from`]).
mod column {
    pub(super) const FINGERPRINT: usize = 0;
    pub(super) const FINGERPRINT_VERSION: usize = 1;
    pub(super) const STATE: usize = 2;
    pub(super) const TOKEN: usize = 3;
    pub(super) const ATTEMPT: usize = 4;
    pub(super) const LEASE_UNTIL: usize = 5;
    pub(super) const CHECKPOINT: usize = 6;
    pub(super) const RESPONSE_STATUS: usize = 7;
    pub(super) const RESPONSE_HEADERS: usize = 8;
    pub(super) const RESPONSE_BODY: usize = 9;
    pub(super) const CREATED_AT: usize = 10;
    pub(super) const COMPLETED_AT: usize = 11;
    pub(super) const EXPIRES_AT: usize = 12;
    pub(super) const CLAIM_ID: usize = 13;
}

/// The record in `row` from column `at` on ([`RECORD_COLUMNS`]), or `None` if the join found
/// no row.
pub(super) fn record_from(row: &Row, at: usize) -> Result<Option<Record>> {
    let Some(state) = col::<Option<String>>(row, at + column::STATE)? else {
        return Ok(None);
    };
    let need = |what: &str| Error::corrupted(format!("a {state} record has no {what}"));
    let digest: Vec<u8> = col(row, at + column::FINGERPRINT)?;
    let digest: [u8; 32] = digest
        .as_slice()
        .try_into()
        .map_err(|_| Error::corrupted(format!("a fingerprint of {} bytes", digest.len())))?;
    let version: i16 = col(row, at + column::FINGERPRINT_VERSION)?;
    let version = u8::try_from(version)
        .map_err(|_| Error::corrupted(format!("fingerprint version {version}")))?;
    let state = match state.as_str() {
        "in_progress" => State::InProgress {
            token: token_col(row, at + column::TOKEN)?,
            lease_until: col::<Option<i64>>(row, at + column::LEASE_UNTIL)?
                .ok_or_else(|| need("lease deadline"))
                .and_then(|v| {
                    u64::try_from(v).map_err(|_| Error::corrupted("a negative lease deadline"))
                })?,
            checkpoint: col(row, at + column::CHECKPOINT)?,
            claim_id: col::<Option<i64>>(row, at + column::CLAIM_ID)?
                .map(|id| u64::from_ne_bytes(id.to_ne_bytes())),
        },
        "completed" => {
            let status: i32 = col::<Option<i32>>(row, at + column::RESPONSE_STATUS)?
                .ok_or_else(|| need("status"))?;
            let headers: Vec<u8> = col::<Option<Vec<u8>>>(row, at + column::RESPONSE_HEADERS)?
                .ok_or_else(|| need("headers"))?;
            let body: Vec<u8> = col::<Option<Vec<u8>>>(row, at + column::RESPONSE_BODY)?
                .ok_or_else(|| need("body"))?;
            let completed_at: i64 = col::<Option<i64>>(row, at + column::COMPLETED_AT)?
                .ok_or_else(|| need("completion time"))?;
            State::Completed {
                completed_at: u64::try_from(completed_at)
                    .map_err(|_| Error::corrupted("a negative completion time"))?,
                response: Response {
                    status: u16::try_from(status)
                        .map_err(|_| Error::corrupted(format!("response status {status}")))?,
                    headers: decode_headers(&headers)?,
                    body,
                },
                token: Some(token_col(row, at + column::TOKEN)?),
            }
        }
        other => return Err(Error::corrupted(format!("unknown record state {other:?}"))),
    };
    Ok(Some(Record {
        fingerprint: Fingerprint::from_raw(version, digest),
        created_at: millis_col(row, at + column::CREATED_AT)?,
        expires_at: millis_col(row, at + column::EXPIRES_AT)?,
        attempt: attempt_col(row, at + column::ATTEMPT)?,
        state,
    }))
}

/// Checks one row of the `verify` walk, appending a line per problem.
pub(super) fn check_row(row: &Row, problems: &mut Vec<String>, max_token: &mut u64) -> Result<()> {
    let scope: String = col(row, 0)?;
    let key: String = col(row, 1)?;
    let name = if scope.is_empty() {
        key.clone()
    } else {
        format!("{scope}/{key}")
    };
    let mut problem = |what: String| problems.push(format!("record {name:?}: {what}"));
    let parsed = if scope.is_empty() {
        Key::new(&key)
    } else {
        Key::scoped(&scope, &key)
    };
    if let Err(e) = parsed {
        problem(e.to_string());
    }
    let fp_len: i32 = col(row, 2)?;
    if fp_len != 32 {
        problem(format!("fingerprint of {fp_len} bytes, not 32"));
    }
    let fp_version: i16 = col(row, 3)?;
    if u8::try_from(fp_version).is_err() {
        problem(format!("fingerprint version {fp_version} out of range"));
    }
    let state: String = col(row, 4)?;
    let token: i64 = col(row, 5)?;
    let attempt: i64 = col(row, 6)?;
    let lease_until: Option<i64> = col(row, 7)?;
    let has_checkpoint: bool = col(row, 8)?;
    let status: Option<i32> = col(row, 9)?;
    let headers: Option<Vec<u8>> = col(row, 10)?;
    let has_body: bool = col(row, 11)?;
    let created_at: i64 = col(row, 12)?;
    let completed_at: Option<i64> = col(row, 13)?;
    let expires_at: i64 = col(row, 14)?;
    match u64::try_from(token) {
        Ok(t) if t > 0 => *max_token = (*max_token).max(t),
        _ => problem(format!("token {token} is not positive")),
    }
    if u32::try_from(attempt).map_or(true, |a| a == 0) {
        problem(format!("attempt {attempt} out of range"));
    }
    if created_at < 0 || expires_at <= created_at {
        problem(format!(
            "expires at {expires_at}, not after its creation at {created_at}"
        ));
    }
    match state.as_str() {
        "in_progress" => {
            match lease_until {
                None => problem("in progress without a lease deadline".to_owned()),
                Some(until) if until > expires_at => problem(format!(
                    "expires at {expires_at}, before its lease ends at {until}"
                )),
                Some(_) => {}
            }
            if status.is_some() || headers.is_some() || has_body || completed_at.is_some() {
                problem("in progress but holds a response".to_owned());
            }
        }
        "completed" => {
            if lease_until.is_some() || has_checkpoint {
                problem("completed but holds a lease or checkpoint".to_owned());
            }
            match status {
                Some(s) if u16::try_from(s).is_ok() => {}
                other => problem(format!("completed with response status {other:?}")),
            }
            match headers.as_deref().map(decode_headers) {
                Some(Ok(_)) => {}
                Some(Err(e)) => problem(e.to_string()),
                None => problem("completed without response headers".to_owned()),
            }
            if !has_body {
                problem("completed without a response body".to_owned());
            }
            match completed_at {
                Some(at) if at >= created_at && expires_at > at => {}
                other => problem(format!(
                    "completed at {other:?}, not between its creation at {created_at} and its \
                     expiry at {expires_at}"
                )),
            }
        }
        other => problem(format!("unknown state {other:?}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_that_may_follow_a_workers_commit_leave_the_outcome_unknown() {
        for code in ["XX000", "08006", "08003", "57P01", "57014", "58030"] {
            assert!(!rolled_back(code), "{code}");
        }
        for code in [
            "23505", "40001", "40P01", "42P01", "22001", "55P03", "25P02",
        ] {
            assert!(rolled_back(code), "{code}");
        }
    }

    #[test]
    fn column_positions_match_the_column_list() {
        let names: Vec<&str> = RECORD_COLUMNS.split(',').map(str::trim).collect();
        for (position, name) in [
            (column::FINGERPRINT, "r.fingerprint"),
            (column::FINGERPRINT_VERSION, "r.fingerprint_version"),
            (column::STATE, "r.state"),
            (column::TOKEN, "r.token"),
            (column::ATTEMPT, "r.attempt"),
            (column::LEASE_UNTIL, "r.lease_until"),
            (column::CHECKPOINT, "r.checkpoint"),
            (column::RESPONSE_STATUS, "r.response_status"),
            (column::RESPONSE_HEADERS, "r.response_headers"),
            (column::RESPONSE_BODY, "r.response_body"),
            (column::CREATED_AT, "r.created_at"),
            (column::COMPLETED_AT, "r.completed_at"),
            (column::EXPIRES_AT, "r.expires_at"),
            (column::CLAIM_ID, "r.claim_id"),
        ] {
            assert_eq!(names.get(position), Some(&name), "column {position}");
        }
        assert_eq!(names.len(), 14);
    }

    #[test]
    fn headers_round_trip_through_their_encoding() -> Result<()> {
        let headers = vec![
            ("Content-Type".to_owned(), b"application/json".to_vec()),
            ("X-Dup".to_owned(), vec![0xff, 0]),
        ];
        let bytes = postcard::to_allocvec(&headers).map_err(|e| Error::storage("test", e))?;
        assert_eq!(decode_headers(&bytes)?, headers);
        let mut long = bytes.clone();
        long.push(0);
        assert!(decode_headers(&long).is_err());
        Ok(())
    }
}
