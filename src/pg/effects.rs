//! The caller's own statements in the store's transaction: [`PgStore::complete_with`] and
//! [`PgStore::read_with`].

use ::postgres::{IsolationLevel, Transaction};

use super::PgStore;
use super::rows::{parts, pg, token_param};
use crate::api::outcome::Lease;
use crate::api::response::Response;
use crate::error::{Error, Result};

impl PgStore {
    /// Like [`complete`](crate::IdempotencyStore::complete), but first runs `effect` in the
    /// same PostgreSQL transaction, so the caller's own rows (a ledger, an outbox) and the
    /// stored response commit together or not at all.
    ///
    /// The transaction first locks the record, fenced by the lease's token: if the lease is
    /// lost, `effect` does not run and the call fails with [`Error::LeaseLost`]. While `effect`
    /// runs, no other attempt can take the key over (a concurrent takeover waits for the row).
    /// The response is then stored with the same fence; if that finds the lease gone (the
    /// record expired meanwhile, or `effect` itself changed it), everything `effect` did is
    /// rolled back and the call fails with [`Error::LeaseLost`]. If `effect` returns `Err`,
    /// the transaction is rolled back, no response is stored, the lease still holds, and the
    /// error comes back as `Ok(Err(e))`.
    ///
    /// `effect` must be `Send`: inside a tokio runtime the call runs on a helper thread (see
    /// [`PgStore`]'s section on async services). It gets a
    /// [`postgres::Transaction`] on the store's connection (the crate
    /// re-exports [`postgres`] so the versions match), at READ COMMITTED. Do not commit it, and return its errors: a statement that failed
    /// aborts the transaction, and the call then fails with [`Error::Storage`] when it stores
    /// the response, committing nothing.
    ///
    /// ```no_run
    /// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, pg::PgStore, Response};
    ///
    /// let store = PgStore::connect("host=127.0.0.1 user=idem password=idem dbname=idem")?;
    /// let Claim::Acquired(lease) = store.claim(&Key::new("charge-1")?, Fingerprint::of(["4999"]))?
    /// else {
    ///     return Ok(());
    /// };
    /// store.complete_with(&lease, Response::new(201, "charged"), |tx| {
    ///     tx.execute("INSERT INTO ledger (key, amount) VALUES ($1, $2)", &[&"charge-1", &4999i64])?;
    ///     Ok::<_, idempotency_store::pg::postgres::Error>(())
    /// })??;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// The redb [`Store::complete_with`](crate::Store::complete_with) takes a redb transaction
    /// instead, so this method is not on [`IdempotencyStore`](crate::IdempotencyStore): code
    /// generic over the backend puts its effect behind a trait of its own with one
    /// implementation per backend (for example `trait Ledger { fn charge(&self, lease:
    /// &Lease, …) }` for `Store` and for `PgStore`), each calling its backend's
    /// `complete_with`.
    ///
    /// # Errors
    /// The outer result: [`Error::ResponseTooLarge`] or [`Error::LeaseLost`] (nothing was
    /// committed); [`Error::Storage`] if a statement or the commit failed (if the commit
    /// itself failed, the outcome is unknown: look the key up). The inner result: `effect`'s
    /// error.
    pub fn complete_with<E, F>(
        &self,
        lease: &Lease,
        response: Response,
        effect: F,
    ) -> Result<std::result::Result<(), E>>
    where
        E: Send,
        F: FnOnce(&mut Transaction<'_>) -> std::result::Result<(), E> + Send,
    {
        self.check_size(response.size())?;
        let headers = postcard::to_allocvec(&response.headers)
            .map_err(|e| Error::storage("encoding response headers", e))?;
        let status = i32::from(response.status);
        let token = token_param(lease.token)?;
        let (scope, name) = parts(&lease.key);
        let done = self.with_write_conn(|client, st| {
            let mut txn = client
                .transaction()
                .map_err(|e| pg("starting a transaction", e))?;
            let now = self.now_param();
            if st
                .lock_lease
                .query_opt(&mut txn, &[&now, &scope, &name, &token])
                .map_err(|e| pg("locking a record", e))?
                .is_none()
            {
                return Err(Error::LeaseLost);
            }
            if let Err(err) = effect(&mut txn) {
                return Ok(Err(err));
            }
            let now = self.now_param();
            let stored = st
                .complete
                .query_opt(
                    &mut txn,
                    &[
                        &now,
                        &scope,
                        &name,
                        &token,
                        &status,
                        &headers,
                        &response.body,
                        &self.retention_of(lease),
                    ],
                )
                .map_err(|e| pg("completing a lease after the caller's statements", e))?;
            if stored.is_none() {
                return Err(Error::LeaseLost);
            }
            txn.commit()
                .map_err(|e| pg("committing the caller's statements and the response", e))?;
            Ok(Ok(()))
        });
        // A retry that finds its own completion: the statements committed with it.
        match done {
            Ok(ran) => Ok(ran),
            Err(err) => self.settle(lease, Err(err), Some(&response)).map(Ok),
        }
    }

    /// Runs `read` in a read-only REPEATABLE READ transaction on one of the store's
    /// connections, for the caller's own tables (written with
    /// [`complete_with`](PgStore::complete_with)): every statement in it sees one snapshot.
    ///
    /// ```no_run
    /// use idempotency_store::pg::PgStore;
    ///
    /// let store = PgStore::connect("host=127.0.0.1 user=idem password=idem dbname=idem")?;
    /// let rows: i64 = store.read_with(|tx| {
    ///     tx.query_one("SELECT count(*) FROM ledger", &[])?.try_get(0)
    /// })??;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// The outer result: [`Error::Storage`] if the transaction cannot start or end. The inner
    /// result: `read`'s own (the transaction is then rolled back).
    pub fn read_with<T: Send, E: Send>(
        &self,
        read: impl FnOnce(&mut Transaction<'_>) -> std::result::Result<T, E> + Send,
    ) -> Result<std::result::Result<T, E>> {
        self.with_conn(|client, _| {
            let mut txn = client
                .build_transaction()
                .isolation_level(IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .map_err(|e| pg("starting a read", e))?;
            let value = match read(&mut txn) {
                Ok(value) => value,
                Err(err) => return Ok(Err(err)),
            };
            txn.commit().map_err(|e| pg("ending a read", e))?;
            Ok(Ok(value))
        })
    }
}
