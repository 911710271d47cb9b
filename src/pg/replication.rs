//! [`FailoverSafety`]: whether a claim acknowledged by the server a [`PgStore`] is on survives
//! that server's failover, read from the server's settings and its replication view; and the
//! refusal of a read-only server.

use std::fmt;

use ::postgres::{Client, SimpleQueryMessage, SimpleQueryRow};

#[cfg(doc)]
use super::PgStore;
#[cfg(doc)]
use super::PgStoreBuilder;
use super::rows::pg;
use crate::error::{Error, Result};

/// The settings, then the standbys (one row each). Simple-query protocol: no prepared
/// statement, one round trip, and safe behind a transaction-pooling proxy.
const READ: &str = "SELECT pg_is_in_recovery()::text, current_setting('transaction_read_only'), \
     current_setting('default_transaction_read_only'), \
     current_setting('synchronous_standby_names'), current_setting('synchronous_commit'); \
     SELECT coalesce(application_name, ''), coalesce(sync_state, '') FROM pg_stat_replication";

/// Whether a claim that [`PgStore`] acknowledged survives a failover of the server it was
/// made on, as that server's settings and replication state say.
///
/// A commit is failover-safe when the server waits, before acknowledging it, for a
/// synchronous standby to hold it: `synchronous_standby_names` names one or more standbys and
/// the transaction's `synchronous_commit` is `on` or `remote_apply`. `PgStore`'s own
/// transactions raise `synchronous_commit` to at least `on` themselves, so a role's or a
/// session's `local` or `off` cannot weaken them; what decides is then whether the server has
/// synchronous standbys at all. It still takes a failover that promotes one of them (Patroni's
/// `synchronous_mode`, pg_auto_failover with `number_sync_standbys` ≥ 1 do): promoting an
/// asynchronous standby loses what it had not received.
///
/// Read when the store connects ([`PgStore::failover_safety_at_connect`], with a `tracing`
/// warning and, with [`PgStoreBuilder::require_failover_safe`], a refusal when not safe), on
/// demand ([`PgStore::failover_safety`]), and while the store runs: on each new pooled
/// connection's first use and once per [`PgStoreBuilder::failover_check_period`] (its findings
/// in `stats()` and `metrics()`, as [`FailoverStatus`](crate::admin::FailoverStatus)). Its `Display` is one line that starts with
/// `failover-safe` or `not failover-safe`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailoverSafety {
    /// The server's `synchronous_standby_names`, as set; empty when commits wait for no
    /// standby (asynchronous replication, or none).
    pub synchronous_standby_names: String,
    /// The `synchronous_commit` the store's transactions commit with: `on`, or
    /// `remote_apply` if the session's setting is that.
    pub synchronous_commit: String,
    /// The standbys streaming from the server now as synchronous (`sync_state` `sync` or
    /// `quorum` in `pg_stat_replication`), by `application_name`; `None` if the store's role
    /// cannot see them (it needs the privileges of `pg_read_all_stats`, e.g. `pg_monitor`).
    /// None connected while standbys are named means that commits wait until one connects.
    pub synchronous_standbys: Option<Vec<String>>,
}

impl FailoverSafety {
    /// Whether an acknowledged claim, completion or release survives a failover to a
    /// synchronous standby: commits wait for a synchronous standby.
    #[must_use]
    pub fn is_failover_safe(&self) -> bool {
        !self.synchronous_standby_names.trim().is_empty()
            && matches!(self.synchronous_commit.as_str(), "on" | "remote_apply")
    }
}

impl fmt::Display for FailoverSafety {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let commit = &self.synchronous_commit;
        if !self.is_failover_safe() {
            return write!(
                f,
                "not failover-safe: synchronous_standby_names is empty, so the server \
                 acknowledges commits before any standby has them (synchronous_commit = \
                 {commit}); a failover can lose acknowledged claims and completions, and their \
                 operations can then run twice; set synchronous_standby_names (or your HA \
                 manager's synchronous mode; with Patroni, synchronous_mode_strict too, or a \
                 new primary runs without a synchronous standby for a few seconds)"
            );
        }
        let names = &self.synchronous_standby_names;
        write!(
            f,
            "failover-safe: commits wait for a synchronous standby \
             (synchronous_standby_names = '{names}', synchronous_commit = {commit}); "
        )?;
        match &self.synchronous_standbys {
            None => write!(
                f,
                "connected synchronous standbys not visible to this role (grant pg_monitor)"
            ),
            Some(standbys) if standbys.is_empty() => write!(
                f,
                "no synchronous standby is connected: commits wait until one is"
            ),
            Some(standbys) => write!(f, "synchronous standbys: {}", standbys.join(", ")),
        }
    }
}

const CONTEXT: &str = "reading the server's replication settings";

/// Reads the server's report, failing if the server is read-only.
pub(super) fn read(client: &mut Client) -> Result<FailoverSafety> {
    let messages = client.simple_query(READ).map_err(|e| pg(CONTEXT, e))?;
    parse(&messages)
}

/// As [`read`], before a call's own statements: a failure leaves the call undone.
pub(super) fn recheck(client: &mut Client) -> Result<FailoverSafety> {
    let messages = client
        .simple_query(READ)
        .map_err(|e| Error::not_applied(CONTEXT, e))?;
    parse(&messages)
}

fn parse(messages: &[SimpleQueryMessage]) -> Result<FailoverSafety> {
    let rows: Vec<&SimpleQueryRow> = messages
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .collect();
    let Some((settings, standbys)) = rows.split_first() else {
        return Err(Error::corrupted("the server answered no settings"));
    };
    let text = |row: &SimpleQueryRow, i: usize| row.get(i).unwrap_or_default().to_owned();
    let on = |i: usize| matches!(settings.get(i), Some("on" | "true"));
    if on(0) || on(1) || on(2) {
        return Err(read_only(on(0)));
    }
    let visible = standbys
        .iter()
        .all(|row| !row.get(1).unwrap_or("").is_empty());
    Ok(FailoverSafety {
        synchronous_standby_names: text(settings, 3),
        synchronous_commit: in_force(settings.get(4).unwrap_or_default()).to_owned(),
        synchronous_standbys: visible.then(|| {
            standbys
                .iter()
                .filter(|row| matches!(row.get(1), Some("sync" | "quorum")))
                .map(|row| text(row, 0))
                .collect()
        }),
    })
}

/// The `synchronous_commit` the store's statements commit with, given the session's (see
/// `lock::DURABLE`).
fn in_force(session: &str) -> &'static str {
    if session == "remote_apply" {
        "remote_apply"
    } else {
        "on"
    }
}

fn read_only(in_recovery: bool) -> Error {
    let what = if in_recovery {
        "a standby in recovery (pg_is_in_recovery() is true)"
    } else {
        "read-only (default_transaction_read_only or transaction_read_only is on)"
    };
    Error::InvalidConfig {
        reason: format!(
            "the PostgreSQL server connected to is {what}, and PgStore writes: connect to the \
             primary; with several hosts (or a standby among them) add \
             target_session_attrs=read-write to the connection string, so that the client \
             picks the server that accepts writes, also after a failover"
        ),
    }
}

/// The refusal of [`PgStoreBuilder::require_failover_safe`].
pub(super) fn refuse(report: &FailoverSafety) -> Error {
    Error::InvalidConfig {
        reason: format!("require_failover_safe is set, and the server is {report}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(names: &str, standbys: Option<&[&str]>) -> FailoverSafety {
        FailoverSafety {
            synchronous_standby_names: names.to_owned(),
            synchronous_commit: in_force("local").to_owned(),
            synchronous_standbys: standbys.map(|s| s.iter().map(|&n| n.to_owned()).collect()),
        }
    }

    #[test]
    fn named_standbys_make_commits_failover_safe() {
        let safe = report("*", Some(&["15/standby"]));
        assert!(safe.is_failover_safe());
        assert!(safe.to_string().starts_with("failover-safe"), "{safe}");
        assert!(safe.to_string().contains("15/standby"), "{safe}");
        let waiting = report("ANY 1 (a, b)", Some(&[]));
        assert!(waiting.is_failover_safe());
        assert!(
            waiting
                .to_string()
                .contains("no synchronous standby is connected")
        );
    }

    #[test]
    fn no_named_standby_is_not_failover_safe() {
        for names in ["", "  "] {
            let unsafe_ = report(names, Some(&[]));
            assert!(!unsafe_.is_failover_safe());
            assert!(
                unsafe_.to_string().starts_with("not failover-safe"),
                "{unsafe_}"
            );
        }
    }

    #[test]
    fn a_weak_session_default_is_raised() {
        for weak in ["off", "local", "remote_write", "on"] {
            assert_eq!(in_force(weak), "on");
        }
        assert_eq!(in_force("remote_apply"), "remote_apply");
    }

    #[test]
    fn a_read_only_server_names_the_fix() {
        for recovery in [true, false] {
            assert!(
                read_only(recovery)
                    .to_string()
                    .contains("target_session_attrs=read-write")
            );
        }
    }
}
