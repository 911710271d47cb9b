//! Store settings and the builder that opens a store with them.

use std::path::Path;
use std::sync::Arc;

use crate::api::clock::{Clock, SystemClock, millis};
use crate::api::settings::{Settings, WhenFull, invalid_config};
use crate::engine::batch::Quota;
use crate::engine::config::Config;
use crate::engine::effects::Registry;
use crate::engine::kept::Unregistered;
use crate::engine::{layout, open};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::store::Store;

/// How the store's merges commit, and so what the first open after a crash repairs.
///
/// Both settings are fully durable: every write call is acknowledged only after its log entry
/// is synced, so it survives a process crash and a power loss either way. They differ in the
/// cost of a merge and of the first open after a crash. See `docs/durability.md`, "What
/// survives a crash". (Not to be confused with `redb::Durability`, which says whether one redb
/// commit is synced at all.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Recovery {
    /// Each batch is one durable log write; the merges that move the log into redb are
    /// one-phase redb commits with checksums (one `fdatasync` each). After a crash the next
    /// open verifies and repairs the whole file, which takes time proportional to its size,
    /// then replays the log. The default.
    #[default]
    FullRepair,
    /// Batches are logged as under `FullRepair`; merges are two-phase redb commits with
    /// redb's quick repair (two `fdatasync`s and a copy of the allocator state each), so redb's
    /// part of the first open after a crash is instant regardless of file size, and only the
    /// log is replayed. Two-phase commit also resists a torn commit forged by someone who
    /// controls both the bytes written and the moment of the crash.
    QuickRepair,
}

/// Settings for opening a [`Store`]. Every setter states its default.
///
/// ```
/// use idempotency_store::{Recovery, Store};
/// use std::time::Duration;
///
/// let store = Store::builder()
///     .retention(Duration::from_secs(3600))
///     .lease(Duration::from_secs(30))
///     .recovery(Recovery::QuickRepair)
///     .open_in_memory()?;
/// # Ok::<(), idempotency_store::Error>(())
/// ```
#[derive(Clone)]
pub struct StoreBuilder {
    pub(crate) settings: Settings,
    pub(crate) recovery: Recovery,
    pub(crate) cache_size: usize,
    pub(crate) max_batch: usize,
    pub(crate) log_size: u64,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    pub(crate) create_if_missing: bool,
    pub(crate) portable_log_sync: bool,
    pub(crate) effects: Registry,
    pub(crate) keep_unregistered_effects: bool,
    pub(crate) replay_cache: usize,
}

impl Default for StoreBuilder {
    fn default() -> Self {
        StoreBuilder {
            settings: Settings::default(),
            recovery: Recovery::FullRepair,
            cache_size: 8 << 20,
            max_batch: 128,
            log_size: layout::DEFAULT_LOG_LEN,
            clock: None,
            replay_cache: 4 << 20,
            create_if_missing: true,
            portable_log_sync: false,
            effects: Registry::default(),
            keep_unregistered_effects: false,
        }
    }
}

impl std::fmt::Debug for StoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreBuilder")
            .field("settings", &self.settings)
            .field("recovery", &self.recovery)
            .field("cache_size", &self.cache_size)
            .field("max_batch", &self.max_batch)
            .field("log_size", &self.log_size)
            .field("injected_clock", &self.clock.is_some())
            .field("create_if_missing", &self.create_if_missing)
            .field("portable_log_sync", &self.portable_log_sync)
            .field("effect_tables", &self.effects)
            .field("keep_unregistered_effects", &self.keep_unregistered_effects)
            .field("replay_cache", &self.replay_cache)
            .finish_non_exhaustive()
    }
}

impl StoreBuilder {
    /// A builder with every setting at its default.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    crate::api::settings::shared_setters!(settings);

    /// How merges commit, and what the first open after a crash repairs. Defaults to
    /// [`Recovery::FullRepair`].
    pub fn recovery(&mut self, recovery: Recovery) -> &mut Self {
        self.recovery = recovery;
        self
    }

    /// redb's page cache, in bytes. redb's own default (1 GiB) suits a database server, not an
    /// edge device; the hot part of an idempotency store (recent keys) is small. redb also
    /// keeps the pages changed since the last merge in a write buffer of up to half this size,
    /// so the store's page memory is up to 1.5 times it. Defaults to 8 MiB. Replays of keys not
    /// recently written read their pages through this cache, so a cache too small for them
    /// slows replays beside busy writers; the cost of a larger one is resident memory
    /// (BENCHMARKS.md, "Figures behind the defaults"). Raise it if replays of older keys
    /// dominate, lower it for a small device.
    pub fn cache_size(&mut self, bytes: usize) -> &mut Self {
        self.cache_size = bytes;
        self
    }

    /// Memory for replays answered without reading the store, in bytes (default 4 MiB; 0 turns
    /// it off): a claim of a completed key that replayed before is answered from it, without
    /// a read transaction, and so is [`IdempotencyStore::cached_replay`](crate::IdempotencyStore::cached_replay), which the tower layer uses so
    /// that a retry of a completed key is answered on the async thread. Each kept replay costs
    /// its key, headers and body plus about 160 bytes; the oldest go first. From 128 KiB on,
    /// the memory is split into up to 16 shards of at least 64 KiB, so that cores replaying
    /// different keys do not share a lock; a replay larger than one shard is not kept.
    pub fn replay_cache(&mut self, bytes: usize) -> &mut Self {
        self.replay_cache = bytes;
        self
    }

    /// The most write calls that share one commit (group commit). 1 turns group commit off:
    /// every call then pays its own commit. Defaults to 128.
    pub fn max_batch(&mut self, calls: usize) -> &mut Self {
        self.max_batch = calls;
        self
    }

    /// The size of the write-ahead log of a new store file, in bytes: a multiple of 4 KiB, at least
    /// 16 KiB and at most 1 TiB (outside that, opening fails with [`Error::InvalidConfig`]; an open
    /// checks the size a file's header names against the same bounds). Each write batch appends to
    /// the log and syncs it; when the log is full, its changes commit durably into the database (a
    /// merge) and the log starts over. A bigger log means fewer merges, and larger groups of
    /// records written into the database between them (1024 per MiB of log, up to 16 MiB): more
    /// throughput with many threads, for a larger file and more memory (redb reuses the pages freed
    /// since the last merge only after the next one); BENCHMARKS.md, "Figures behind the defaults",
    /// has what 4, 8 and 16 MiB bought and cost against 1 MiB with 10^6 records written by 64
    /// threads, and why the default is 4 MiB (claim latency while a mass expiry is swept). A smaller log means a smaller file, a shorter replay after a crash and less
    /// memory. A batch bigger than the log simply merges. An existing file keeps the size it was
    /// created with. A store from [`open_in_memory`](StoreBuilder::open_in_memory) has no log, and
    /// its groups are always 16,384 records. Defaults to 4 MiB.
    pub fn log_size(&mut self, bytes: u64) -> &mut Self {
        self.log_size = bytes;
        self
    }

    /// Whether [`open`](StoreBuilder::open) creates a store file that does not exist. Defaults to
    /// true, so that [`Store::open`] creates its file as it always has. Turn it off where the
    /// file must already exist (a service restarting on its store): a mistyped path then
    /// fails with [`Error::NotAStore`] instead of creating an empty store, which would run
    /// every retry again.
    ///
    /// ```
    /// use idempotency_store::{Error, Store};
    ///
    /// let dir = tempfile::tempdir().expect("temp dir");
    /// let typo = Store::builder().create_if_missing(false).open(dir.path().join("stroe.redb"));
    /// assert!(matches!(typo, Err(Error::NotAStore { .. })));
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    pub fn create_if_missing(&mut self, create: bool) -> &mut Self {
        self.create_if_missing = create;
        self
    }

    /// How the log's writes become durable on a store opened on a file. On Linux, by default,
    /// through a handle opened with `O_DSYNC`: a write returns once it is durable, including
    /// the disk's cache flush, and syncs only the range written. On every other platform, and
    /// on Linux with this switch on, each log write is followed by `sync_data` (`fdatasync`;
    /// `F_FULLFSYNC` on Apple platforms, where `O_DSYNC`, like `fsync`, leaves the data in
    /// the drive's cache). Turn it on to run the portable path on Linux (the crash tests run
    /// both), or on a Linux file system whose `O_DSYNC` is not a full barrier. Defaults to
    /// false. No effect on a store opened with a custom backend, whose log writes are the
    /// backend's write and `sync_data`.
    pub fn portable_log_sync(&mut self, portable: bool) -> &mut Self {
        self.portable_log_sync = portable;
        self
    }

    /// Registers `table`, one of the caller's own redb tables, for the effects of
    /// [`Store::complete_with_effects`]: they may write it, and an open replays its rows from
    /// the log after a crash, which needs its key and value types. Register every table the
    /// effects write, at every open (the same definition each time); a file whose log holds
    /// rows of a table not registered is refused with [`Error::EffectTable`] (unless
    /// [`keep_unregistered_effects`](StoreBuilder::keep_unregistered_effects)). No tables by
    /// default. Registering a name twice keeps the last.
    ///
    /// ```
    /// use idempotency_store::{Store, redb::TableDefinition};
    ///
    /// const LEDGER: TableDefinition<&str, u64> = TableDefinition::new("ledger");
    /// let store = Store::builder().effect_table(LEDGER).open_in_memory()?;
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    pub fn effect_table<K: redb::Key + 'static, V: redb::Value + 'static>(
        &mut self,
        table: redb::TableDefinition<'_, K, V>,
    ) -> &mut Self {
        self.effects.register(table);
        self
    }

    /// Whether a writable open accepts a file whose log holds rows of effect tables that are
    /// not registered, instead of refusing it with [`Error::EffectTable`]. For tools that
    /// maintain an application's file without knowing its tables (the CLI's `sweep` and
    /// `release`) and never write effects themselves. Defaults to false.
    ///
    /// The rows are not lost: the open keeps them, in the same commit that retires their log
    /// entries, in a table of the store's own, and the next open that registers their table
    /// applies them (before the log's newer rows), as if it had replayed them from the log.
    /// An open that does not register it refuses the file, as it would refuse the log. While
    /// rows wait, the file's format version is 6 (5 otherwise), so that builds that do not know
    /// the table refuse the file instead of losing them.
    ///
    /// ```
    /// use idempotency_store::IdempotencyStore;
    /// use idempotency_store::Store;
    ///
    /// let dir = tempfile::tempdir().expect("temp dir");
    /// let path = dir.path().join("app.redb");
    /// # Store::open(&path)?.close()?;
    /// // An operator tool: whatever effect tables the application uses, it may sweep.
    /// let tool = Store::builder().keep_unregistered_effects(true).open(&path)?;
    /// tool.sweep(64)?;
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    pub fn keep_unregistered_effects(&mut self, keep: bool) -> &mut Self {
        self.keep_unregistered_effects = keep;
        self
    }

    /// Opens the store file at `path`, creating it if it does not exist (unless
    /// [`create_if_missing`](StoreBuilder::create_if_missing) is off).
    ///
    /// A new file is made durable before any call can use it: the log region is zeroed and
    /// synced, redb's part created, the store's header written and synced last, and the
    /// directory synced so that the file's name survives a power loss. A file whose creation
    /// was cut short has no header and is refused with a message that says so.
    ///
    /// # Errors
    /// [`Error::AlreadyOpen`] if the file is open elsewhere, [`Error::NotAStore`] if it holds
    /// something else, was never completely created, or is missing while `create_if_missing`
    /// is off, [`Error::Corrupted`] or [`Error::Storage`] if it cannot be read, and
    /// [`Error::InvalidConfig`] for an out-of-range setting.
    pub fn open(&self, path: impl AsRef<Path>) -> Result<Store> {
        self.validate()?;
        let path = path.as_ref();
        let engine = open::open_file(path, self.engine_config())?;
        Ok(Store::new(engine, self.clone(), Some(path.to_path_buf())))
    }

    /// Opens the store file at `path` for reading only, for inspection (the CLI's `stats`,
    /// `list`, `get`, `verify` and `export` use it): the file is opened read-only (`O_RDONLY`
    /// on Unix) and never written, not even by the open, so it works on a read-only file and
    /// leaves a file under investigation byte for byte as it was.
    ///
    /// The store sees what a writable open would: an open after a crash repairs redb's part and
    /// replays the log as always, but into memory: a copy-on-write layer over the file holds
    /// every page the open changed (redb's header and, after a crash, the pages its repair and
    /// the replayed log entries touched) until the store is dropped. Reads work: [`lookup`](crate::IdempotencyStore::lookup), claims that only replay or
    /// reject, [`stats`](crate::IdempotencyStore::stats), [`verify`](crate::IdempotencyStore::verify), [`records`](crate::IdempotencyStore::records),
    /// [`inspect`](crate::IdempotencyStore::inspect), [`metrics`](crate::IdempotencyStore::metrics). Every call that would write
    /// (a claim that would take a key, [`complete`](crate::IdempotencyStore::complete),
    /// [`release`](crate::IdempotencyStore::release), [`heartbeat`](crate::IdempotencyStore::heartbeat),
    /// [`checkpoint`](crate::IdempotencyStore::checkpoint), [`sweep`](crate::IdempotencyStore::sweep),
    /// [`force_release`](crate::IdempotencyStore::force_release), the `complete_with` calls) fails with
    /// [`Error::ReadOnly`], and [`start_sweeper`](Store::start_sweeper) starts no thread.
    /// The file is never created.
    ///
    /// Effect tables: rows the log holds for tables registered with
    /// [`effect_table`](StoreBuilder::effect_table) are replayed as in a writable open; rows of
    /// tables not registered are left out (their types are unknown), where a writable open
    /// refuses the file with [`Error::EffectTable`] (or, with
    /// [`keep_unregistered_effects`](StoreBuilder::keep_unregistered_effects), keeps them).
    /// The store's own records never depend on them.
    ///
    /// The open takes a shared lock on the file: read-only opens may share it, but not with a
    /// writable open (on Linux, where redb's writer also locks the whole file, each makes the
    /// other fail with [`Error::AlreadyOpen`]), so it never reads a file being written.
    ///
    /// ```
    /// use idempotency_store::{IdempotencyStore, Error, Fingerprint, Key, Store, Claim};
    ///
    /// let dir = tempfile::tempdir().expect("temp dir");
    /// let path = dir.path().join("store.redb");
    /// let key = Key::new("order-1")?;
    /// let store = Store::open(&path)?;
    /// let Claim::Acquired(_lease) = store.claim(&key, Fingerprint::of(["a"]))? else { unreachable!() };
    /// store.close()?;
    ///
    /// let before = std::fs::read(&path).expect("read");
    /// let inspect = Store::builder().open_read_only(&path)?;
    /// assert!(inspect.lookup(&key)?.is_some());
    /// let other = Key::new("order-2")?;
    /// assert!(matches!(inspect.claim(&other, Fingerprint::of(["b"])), Err(Error::ReadOnly)));
    /// drop(inspect);
    /// assert_eq!(std::fs::read(&path).expect("read"), before);
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::NotAStore`] if there is no file at `path`, it is empty or holds something
    /// else; [`Error::AlreadyOpen`] if a writable store has it open; [`Error::Corrupted`] or
    /// [`Error::Storage`] if it cannot be read, and [`Error::InvalidConfig`] for an
    /// out-of-range setting.
    pub fn open_read_only(&self, path: impl AsRef<Path>) -> Result<Store> {
        self.validate()?;
        let path = path.as_ref();
        let config = Config {
            read_only: true,
            unregistered: Unregistered::Skip,
            ..self.engine_config()
        };
        let engine = open::open_read_only(path, config)?;
        Ok(Store::new(engine, self.clone(), Some(path.to_path_buf())))
    }

    /// Opens a fresh store held in memory, for tests. Nothing survives the `Store`, so its
    /// claims and settlements write no write-ahead log entry. Since its commits wait for no
    /// I/O, its async calls ([`nonblocking`](crate::IdempotencyStore::nonblocking)) commit on
    /// the caller's own thread rather than handing their batch to a thread of the blocking
    /// pool.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an out-of-range setting.
    pub fn open_in_memory(&self) -> Result<Store> {
        self.validate()?;
        let config = Config {
            in_memory: true,
            ..self.engine_config()
        };
        let backend = Arc::new(redb::backends::InMemoryBackend::new());
        let engine = open::open_backend(backend, config)?;
        Ok(Store::new(engine, self.clone(), None))
    }

    /// Opens a store on a custom redb storage backend (for example one that injects faults in
    /// tests, or encrypts pages).
    ///
    /// # Errors
    /// As for [`StoreBuilder::open`].
    pub fn open_with_backend(&self, backend: impl redb::StorageBackend) -> Result<Store> {
        self.validate()?;
        let engine = open::open_backend(Arc::new(backend), self.engine_config())?;
        Ok(Store::new(engine, self.clone(), None))
    }

    /// What the engine needs of these settings.
    fn engine_config(&self) -> Config {
        let quota = self.settings.has_quota().then_some(Quota {
            max_records: self.settings.max_records,
            max_bytes: self.settings.max_bytes,
            evict_completed: self.settings.when_full == WhenFull::EvictOldestCompleted,
        });
        Config {
            lease_ms: millis(self.settings.lease),
            retention_ms: millis(self.settings.retention),
            max_batch: self.max_batch,
            quick_repair: self.recovery == Recovery::QuickRepair,
            quota,
            cache_size: self.cache_size,
            log_size: self.log_size,
            clock: self
                .clock
                .clone()
                .unwrap_or_else(|| Arc::new(SystemClock) as Arc<dyn Clock>),
            create_if_missing: self.create_if_missing,
            portable_log_sync: self.portable_log_sync,
            effects: Arc::new(self.effects.clone()),
            read_only: false,
            unregistered: if self.keep_unregistered_effects {
                Unregistered::Keep
            } else {
                Unregistered::Refuse
            },
            in_memory: false,
        }
    }

    fn validate(&self) -> Result<()> {
        self.settings.validate()?;
        if let Some(name) = self
            .effects
            .names()
            .find(|name| name.starts_with("idempotency_"))
        {
            return invalid_config(&format!(
                "effect table `{name}`: names starting with `idempotency_` are the store's own"
            ));
        }
        if self.max_batch == 0 {
            return invalid_config("max_batch must be at least 1");
        }
        // The same bounds as an open accepts in a header: a store that can be created can be
        // reopened.
        if !(layout::MIN_LOG_LEN..=layout::MAX_LOG_LEN).contains(&self.log_size)
            || !self.log_size.is_multiple_of(4096)
        {
            return invalid_config(
                "log_size must be a multiple of 4096 bytes between 16 KiB and 1 TiB",
            );
        }
        Ok(())
    }
}
