//! Names of the shared-data keys. All are fixed or bounded by the configuration; none is created
//! per request or per session, because shared data can never delete a key.

pub const HEALTH_TABLE: &str = "sgl.health";

/// The round-robin cursor of one policy instance (model / bucket / stage).
pub fn round_robin_cursor(instance: &str) -> String {
    format!("sgl.rr.{instance}")
}

/// One filter VM's in-flight records for every worker (only that VM writes it).
pub fn inflight_share(vm: u64) -> String {
    format!("sgl.inflight.vm.{vm:016x}")
}

/// The dispatch totals of filter VMs that died, folded in by the service.
pub const INFLIGHT_RETIRED: &str = "sgl.inflight.retired";

/// Circuit-breaker state of the workers that have failures or an open breaker.
pub const BREAKERS: &str = "sgl.breakers";

/// The live filter VMs and when each last heartbeated.
pub const VMS: &str = "sgl.vms";

/// The reported-load table the service publishes.
pub const LOAD_TABLE: &str = "sgl.load";

/// The small key beside a large table whose change tells readers to decode the table again.
pub fn version_of(table: &str) -> String {
    format!("{table}.version")
}

/// The queue filters send prefix events to; only the service registers it.
pub const PREFIX_QUEUE: &str = "sgl.prefix.events";

/// One of the affinity store's fixed shards of session and routing-key bindings.
pub fn affinity_shard(shard: u64) -> String {
    format!("sgl.affinity.{shard}")
}

/// Bindings the affinity store's per-shard cap evicted.
pub const AFFINITY_EVICTIONS: &str = "sgl.affinity.evictions";

/// Affinity shards found undecodable and rewritten.
pub const AFFINITY_REPAIRS: &str = "sgl.affinity.repairs";

/// The prefix log's next batch number.
pub const PREFIX_HEAD: &str = "sgl.prefix.head";

/// The prefix trees as of a recent batch, for replicas that fell behind the ring.
pub const PREFIX_SNAPSHOT: &str = "sgl.prefix.snapshot";

/// One slot of the prefix log's fixed ring of batches.
pub fn prefix_log_slot(slot: u64) -> String {
    format!("sgl.prefix.log.{slot}")
}

/// Which VM does the service's work: the singleton, or the filter VM elected (spec §10).
pub const SERVICE_LEASE: &str = "sgl.service.lease";

/// The filter configuration announced last, which the service follows.
pub const FILTER_CONFIG: &str = "sgl.filter_config";

/// One model's waiting queue (spec §9); models are fixed by the configuration.
pub fn waiting_queue(model: &str) -> String {
    format!("sgl.queue.{model}")
}

/// The seats taken at one engine whose group caps `max_inflight_requests`, by VM.
pub fn seats(engine: &str) -> String {
    format!("sgl.seats.{engine}")
}
