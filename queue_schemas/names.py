"""Every Kafka topic, consumer group, Redis key and channel name, in one place."""

from __future__ import annotations

from dataclasses import dataclass

WORKER_INBOX_GROUP = "worker"
INBOX_FIELD = b"m"  # the field of an inbox entry that holds the encoded request


@dataclass(frozen=True, slots=True)
class Names:
    """Names under one deployment prefix (default `sluice`), so several deployments can share a bus."""

    prefix: str = "sluice"

    # Kafka
    def requests_topic(self, pool: str) -> str:
        return f"{self.prefix}.requests.{pool}"

    def batch_topic(self, pool: str) -> str:
        return f"{self.prefix}.batch.{pool}"

    def results_topic(self, team: str) -> str:
        return f"{self.prefix}.results.{team}"

    def deadletter_topic(self) -> str:
        return f"{self.prefix}.deadletter"

    def dispatcher_group(self, pool: str) -> str:
        return f"{self.prefix}.dispatcher.{pool}"

    def usage_topic(self) -> str:
        """One UsageEvent (queue_schemas.usage) per ended request, keyed by its request id."""
        return f"{self.prefix}.usage"

    def batch_api_answers_topic(self) -> str:
        """Answers to the lines of batches created through /v1/batches (internal: services only)."""
        return f"{self.prefix}.batchapi.answers"

    def batch_collector_groups(self, team: str) -> str:
        """The prefix of a team's `sluice batch` consumer groups: the team's alone (team names hold no
        dot, so no team's prefix covers another's)."""
        return f"{self.prefix}.batch-collector.{team}."

    def batch_collector_group(self, team: str, batch_id: str) -> str:
        """The consumer group `sluice batch` collects one batch's answers in."""
        return f"{self.batch_collector_groups(team)}{batch_id}"

    def batch_api_collector_group(self) -> str:
        return f"{self.prefix}.batchapi.collector"

    # Redis keys
    def api_key(self, key_sha256: str) -> str:
        return f"{self.prefix}:apikey:{{{key_sha256}}}"

    def team(self, team: str) -> str:
        return f"{self.prefix}:team:{{{team}}}"

    def signing_keys(self, team: str) -> str:
        """Hash: key id -> base64 Ed25519 public key of the team's batch signers."""
        return f"{self.prefix}:signkeys:{{{team}}}"

    def service_signing_key(self, key_id: str) -> str:
        """Base64 Ed25519 public key of a service (an ingress running /v1/batches) that signs batch lines
        for the team whose key it authenticated."""
        return f"{self.prefix}:svckey:{{{key_id}}}"

    def usage_outbox(self, team: str) -> str:
        """Stream: the team's usage events, written by the settle script, until the relay produces them."""
        return f"{self.prefix}:usage:{{{team}}}"

    def usage_teams(self) -> str:
        """Set of the teams with a usage outbox: where relays find them (never a scan of the keyspace)."""
        return f"{self.prefix}:usageteams"

    def usage_mark(self, team: str, request_id: str) -> str:
        """Set once the request's usage event is written: a request has one event, whoever ends it."""
        return f"{self.prefix}:usagemark:{{{team}}}:{request_id}"

    def file_record(self, team: str, file_id: str) -> str:
        return f"{self.prefix}:file:{{{team}}}:{file_id}"

    def files(self, team: str) -> str:
        """Sorted set: the team's file ids by creation time."""
        return f"{self.prefix}:files:{{{team}}}"

    def batch_record(self, team: str, batch_id: str) -> str:
        return f"{self.prefix}:batchapi:{{{team}}}:{batch_id}"

    def batches(self, team: str) -> str:
        """Sorted set: the team's batch ids by creation time."""
        return f"{self.prefix}:batches:{{{team}}}"

    def batch_lines(self, team: str, batch_id: str) -> str:
        """Hash: input line number -> its output line, one per line however often it is answered."""
        return f"{self.prefix}:batchout:{{{team}}}:{batch_id}"

    def batch_lease(self, team: str, batch_id: str) -> str:
        return f"{self.prefix}:batchlease:{{{team}}}:{batch_id}"

    def active_batches(self) -> str:
        """Set of `<team>/<batch id>` not yet final, which every ingress's batch keeper works through."""
        return f"{self.prefix}:batchapi:active"

    def team_storage(self, team: str) -> str:
        """Hash: what the team holds against its caps (files, bytes, batches, batch_lines)."""
        return f"{self.prefix}:storage:{{{team}}}"

    def team_responses(self, team: str) -> str:
        """Sorted set: the team's stored responses by when each expires (counted against its cap)."""
        return f"{self.prefix}:responses:{{{team}}}"

    def reply_prefix_owners(self) -> str:
        """Hash: every team's reply-topic prefix -> the team, so no two teams' prefixes overlap."""
        return f"{self.prefix}:replyprefixes"

    def file_expiry(self) -> str:
        """Sorted set of `<team>/<file id>` by expiry time, which the batch keepers sweep."""
        return f"{self.prefix}:files:expiry"

    def quota_tokens(self, team: str) -> str:
        return f"{self.prefix}:quota:tpm:{{{team}}}"

    def quota_requests(self, team: str) -> str:
        return f"{self.prefix}:quota:rpm:{{{team}}}"

    def quota_day(self, team: str, day: str) -> str:
        return f"{self.prefix}:quota:day:{{{team}}}:{day}"

    def reservation(self, team: str, request_id: str) -> str:
        """Hash: what a request reserved of its team's quota (in the team's slot, beside the counters)."""
        return f"{self.prefix}:resv:{{{team}}}:{request_id}"

    def held(self, pool: str, dispatcher_id: str) -> str:
        return f"{self.prefix}:held:{{{pool}}}:{dispatcher_id}"

    def dispatchers(self, pool: str) -> str:
        """Sorted set: the pool's live dispatchers, scored by when their registration lapses (ms)."""
        return f"{self.prefix}:dispatchers:{{{pool}}}"

    def partition_lease(self, pool: str) -> str:
        """A format string ({topic}, {partition}) for the lease of one partition (dispatcher.leases)."""
        return f"{self.prefix}:lease:{{{{{pool}}}}}:{{topic}}:{{partition}}"

    def handoff_totals(self, pool: str) -> str:
        """Hash: the pool's handoffs at decode workers: loaded, fallback, and wait_ms (their summed wait)."""
        return f"{self.prefix}:handoffs:{{{pool}}}"

    def migrations(self, pool: str) -> str:
        """Hash: outcome -> how many requests of the pool's lost workers ended so (see dispatcher.metrics)."""
        return f"{self.prefix}:migrations:{{{pool}}}"

    def highwater(self, pool: str) -> str:
        return f"{self.prefix}:highwater:{{{pool}}}"

    def batch_highwater(self, pool: str) -> str:
        return f"{self.prefix}:batch-highwater:{{{pool}}}"

    def pool_state(self, pool: str) -> str:
        return f"{self.prefix}:poolstate:{{{pool}}}"

    def heartbeat(self, pool: str, worker_id: str) -> str:
        return f"{self.prefix}:hb:{pool}:{{{worker_id}}}"

    def workers(self, pool: str) -> str:
        return f"{self.prefix}:workers:{{{pool}}}"

    def kv_index(self, worker_id: str) -> str:
        return f"{self.prefix}:kv:{{{worker_id}}}"

    def kv_snapshot(self, worker_id: str) -> str:
        return f"{self.prefix}:kvsnap:{{{worker_id}}}"

    def recovery_lock(self, worker_id: str) -> str:
        return f"{self.prefix}:recover:{{{worker_id}}}"

    def left_by(self, worker_id: str) -> str:
        """The worker id whose unfinished inbox a restarted process handed over under `worker_id`."""
        return f"{self.prefix}:leftby:{{{worker_id}}}"

    def drain_request(self, worker_id: str) -> str:
        """Set by the scaler: the worker drains (not ready, no new placements) but stays up until it is
        stopped; deleted or expired, the worker is ready again."""
        return f"{self.prefix}:drain:{{{worker_id}}}"

    def started(self, request_id: str) -> str:
        return f"{self.prefix}:started:{{{request_id}}}"

    def inbox(self, worker_id: str) -> str:
        return f"{self.prefix}:inbox:{{{worker_id}}}"

    def placement(self, request_id: str) -> str:
        return f"{self.prefix}:req:{{{request_id}}}"

    def replay(self, request_id: str) -> str:
        """Hash: every chunk of the request published so far, by epoch and seq, and its moves (see
        plumbing.replay)."""
        return f"{self.prefix}:replay:{{{request_id}}}"

    def stream_record(self, request_id: str) -> str:
        """What a completion stream's events are made from, for reading it again (ingress.resume)."""
        return f"{self.prefix}:streamrec:{{{request_id}}}"

    def stream_readers(self, request_id: str) -> str:
        """Counter: readers that came back to a completion stream (ingress.resume)."""
        return f"{self.prefix}:readers:{{{request_id}}}"

    def trace(self, request_id: str) -> str:
        """List: the request's spans as its services recorded them (plumbing.tracing), for the dashboard."""
        return f"{self.prefix}:trace:{{{request_id}}}"

    def slow_traces(self, minute: int) -> str:
        """Sorted set: "<request id> <end>" -> its duration in seconds at the ingress, for the slowest
        requests that ended in that minute (epoch seconds // 60)."""
        return f"{self.prefix}:slow-traces:{minute}"

    def restarts(self) -> str:
        """Hash: process name -> how many times it exited and was started again (dev stack, local workers)."""
        return f"{self.prefix}:restarts"

    def answered(self, request_id: str) -> str:
        return f"{self.prefix}:answered:{{{request_id}}}"

    def response(self, request_id: str) -> str:
        """Hash: a stored response's record (/v1/responses), and when a cancel of it was accepted."""
        return f"{self.prefix}:resp:{{{request_id}}}"

    def cancelled(self, request_id: str) -> str:
        return f"{self.prefix}:cancelled:{{{request_id}}}"

    def kv_ready(self, request_id: str) -> str:
        """List: a disaggregated request's prefill result (KvReady), pushed by its prefill worker."""
        return f"{self.prefix}:kvready:{{{request_id}}}"

    def handoff(self, request_id: str) -> str:
        """Hash: how a disaggregated request's handoff went (both workers, outcome, seconds)."""
        return f"{self.prefix}:handoff:{{{request_id}}}"

    def prefill_jobs(self, worker_id: str) -> str:
        """List: prefill jobs (PrefillJob) for a worker, pushed by decode workers."""
        return f"{self.prefix}:prefill:{{{worker_id}}}"

    # Redis pub/sub channels
    def stream_channel(self, request_id: str) -> str:
        return f"{self.prefix}:stream:{{{request_id}}}"

    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"

    def ingress_control_channel(self) -> str:
        """Keeps an ingress's pub/sub connection subscribed while it has no streams open."""
        return f"{self.prefix}:ingress:control"

    def heartbeat_channel(self, pool: str) -> str:
        return f"{self.prefix}:hb:{pool}"
