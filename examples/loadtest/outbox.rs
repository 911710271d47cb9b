//! The client's outbox as a system under test: a pair is `begin` of a fresh operation and `finish`.

use idempotency_store::client::Outbox;
use idempotency_store::{Claim, Response};

use crate::Res;
use crate::systems::{Client, Fresh, System, fresh_for};
use crate::tools::{err, fingerprint_of};

pub(crate) struct OutboxSys {
    pub(crate) outbox: Outbox,
    pub(crate) cell: u64,
    pub(crate) body: Vec<u8>,
}

pub(crate) struct OutboxClient<'a> {
    pub(crate) sys: &'a OutboxSys,
    pub(crate) fresh: Fresh,
}

impl System for OutboxSys {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>> {
        Ok(Box::new(OutboxClient {
            sys: self,
            fresh: fresh_for(thread, self.cell),
        }))
    }
}

impl Client for OutboxClient<'_> {
    /// Begins a fresh operation (its key durable before `begin` returns) and finishes it.
    fn pair(&mut self) -> Res<()> {
        let name = self.fresh.next();
        match self.sys.outbox.begin(&name, fingerprint_of(&name)) {
            Ok(Claim::Acquired(intent)) => self
                .sys
                .outbox
                .finish(&intent, Response::new(200, self.sys.body.clone()))
                .map_err(|e| err("finish", e)),
            Ok(other) => Err(format!("fresh operation {name} not open: {other:?}")),
            Err(e) => Err(err("begin", e)),
        }
    }

    fn replay(&mut self) -> Res<()> {
        Err("outbox measures pairs only".into())
    }
}
