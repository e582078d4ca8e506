"""Stream, bucket and subject names of docs/architecture.md §2, and the token encoding of keys into subjects.

Model keys and node ids hold `.`, `/`, `:`, spaces and JSON; a subject token cannot. A token is a
readable slug plus 10 hex of the SHA-256 of the full key: routing only, readers check the key in
the body.
"""

from __future__ import annotations

import functools
import hashlib
import re

from schemas.keys import model_parts

EVENTS_STREAM = "NDIF_EVENTS"
# Observed facts of agents and the dispatcher, as they send them (`ndif.fact.…`): stored here first;
# the controller's fact gate (controlplane/service/factgate.py) appends to EVENTS_STREAM, which
# alone is the log, only the facts that decode, name their own source and fit their bounds. No
# atomic batches here, so nothing an agent sends counts against the log's batches in flight.
FACTS_STREAM = "NDIF_FACTS"
# Facts the gate refused, with why (`ndif.refused.<source token>.<facts seq>`): never the log, kept
# bounded, read by the operator (`ndif status`) and by the source itself (its append ends refused).
REFUSED_STREAM = "NDIF_REFUSED"
FACT_GATE_CONSUMER = "fact-gate"  # the gate's durable consumer of FACTS_STREAM (one fact in flight)
REFUSED_PREFIX = "ndif.refused"
REQUESTS_STREAM = "NDIF_REQUESTS"
HEARTBEATS_BUCKET = "ndif_heartbeats"
REQUEST_STATUS_BUCKET = "ndif_request_status"
RESULTS_BUCKET = "ndif_results"
SNAPSHOTS_BUCKET = "ndif_snapshots"

EVENTS_ALL = "ndif.evt.>"
EVENTS_PREFIX = "ndif.evt."
FACT_INBOX_PREFIX = "ndif.fact."  # + what follows `ndif.evt.` in the fact's subject in the log
NODE_EVENTS_PREFIX = "ndif.evt.node."  # + <ntok>
MODEL_EVENTS_PREFIX = "ndif.evt.model."  # + <mtok>
REPLICA_EVENTS_PREFIX = "ndif.evt.replica."  # + <mtok>.<replica_id>[.<source>]
COMMAND_EVENTS_PREFIX = "ndif.evt.cmd."  # + <ctok>
REQUESTS_PREFIX = "ndif.req"
REQUESTS_ALL = "ndif.req.>"
COMMANDS_PREFIX = "ndif.cmd"
STATUS_PREFIX = "ndif.status"
REPLICA_CALLS_PREFIX = "ndif.run"
REPLICA_LOGS_PREFIX = "ndif.logs"  # request/reply: a replica's recent log lines, from its node's agent (admin only)
DISPATCHER_STATE = "ndif.dispatcher.state"  # request/reply: the dispatcher's queue view
REQUEST_CONSUMER_PREFIX = "proc-"  # + <mtok>: a model's durable consumer of userless and unpartitioned requests
# `part<k>-<mtok>`: its consumer of user partition k. Not `proc-`: a dispatcher of the version before
# partitions sweeps every `proc-` consumer whose token it does not know, and would delete these.
REQUEST_PARTITION_CONSUMER_PREFIX = "part"
# A user's request `ndif.req.<mtok>.<user>` is stored as `ndif.req.<mtok>.<user>.<k>`, k the user's
# partition (the stream's subject transform: FNV-1a of the user token, mod REQUEST_PARTITIONS), and
# each partition of a model has a durable consumer of its own (`part<k>-<mtok>`): a request is
# read without reading first the requests stored before it by users of other partitions
# (docs/architecture.md decision 49). `proc-<mtok>` takes userless requests (an open server) and
# those stored before the transform. Changing the count remaps users: it is fixed.
REQUEST_PARTITIONS = 16
REQUESTS_TRANSFORM_SRC = f"{REQUESTS_PREFIX}.*.*"
REQUESTS_TRANSFORM_DEST = f"{REQUESTS_PREFIX}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}.{{{{partition({REQUEST_PARTITIONS},2)}}}}"
DISPATCHER_KILL = "ndif.dispatcher.kill"  # an admin's kill of a request; `.<user>`: a user's own
# Queue figures (schemas/autoscale.py QueueFigures), core NATS, not stored: each dispatcher publishes
# every model's on `ndif.figures.<mtok>` once a second; controllers sum them per model.
FIGURES_PREFIX = "ndif.figures"

# Wildcard filters (subscriptions and the server's permissions, controlplane/ops/auth.py).
NODE_EVENTS_ANY = f"{NODE_EVENTS_PREFIX}*"  # the controller's NodeLost (and node facts stored before they carried a source)
NODE_FACTS_ANY = f"{NODE_EVENTS_PREFIX}*.*"  # an agent's NodeJoined: `ndif.evt.node.<ntok>.<ntok>` (its source last)
MODEL_EVENTS_ANY = f"{MODEL_EVENTS_PREFIX}*"
REPLICA_DECISIONS_ANY = f"{REPLICA_EVENTS_PREFIX}*.*"  # decisions about a replica (no source token)
REPLICA_FACTS_ANY = f"{REPLICA_EVENTS_PREFIX}*.*.*"  # observed replica facts (their source last)
COMMAND_EVENTS_ANY = f"{COMMAND_EVENTS_PREFIX}*"
COMMANDS_ANY = f"{COMMANDS_PREFIX}.*"
STATUS_ALL = f"{STATUS_PREFIX}.>"
REPLICA_CALLS_ALL = f"{REPLICA_CALLS_PREFIX}.>"
FIGURES_ANY = f"{FIGURES_PREFIX}.*"
# Where observed facts are in the log (their source token last).
FACT_LOG_SUBJECTS = (NODE_FACTS_ANY, REPLICA_FACTS_ANY)
# What each stream captures. They do not overlap (the server refuses streams that do): the facts
# stream takes what sources send, the log every event subject, facts only from the gate.
FACTS_SUBJECTS = tuple(FACT_INBOX_PREFIX + s.removeprefix(EVENTS_PREFIX) for s in FACT_LOG_SUBJECTS)
LOG_SUBJECTS = (MODEL_EVENTS_ANY, REPLICA_DECISIONS_ANY, NODE_EVENTS_ANY, COMMAND_EVENTS_ANY, *FACT_LOG_SUBJECTS)

# Headers on every event message.
HDR_MSG_ID = "Nats-Msg-Id"
HDR_EVENT = "Ndif-Event"
HDR_SCHEMA = "Ndif-Schema"
# On a fact in the log: its sequence in FACTS_STREAM (the gate sets it; an append waits for it).
HDR_FACT_SEQ = "Ndif-Fact-Seq"

_SLUG_BAD = re.compile(r"[^A-Za-z0-9_-]+")
_SLUG_MAX = 40


def _token(readable: str, full: str) -> str:
    slug = _SLUG_BAD.sub("_", readable).strip("_")[:_SLUG_MAX] or "x"
    return f"{slug}-{hashlib.sha256(full.encode('utf-8')).hexdigest()[:10]}"


@functools.lru_cache(maxsize=65536)
def model_token(model_key: str) -> str:
    """`<mtok>`: e.g. `openai-community_gpt2-3f9a1c07e2` for the canonical key of that repo."""
    try:
        _, readable, _ = model_parts(model_key)
    except ValueError:
        readable = model_key
    return _token(readable.rsplit("/", 2)[-1] if readable.startswith("/") else readable, model_key)


@functools.lru_cache(maxsize=65536)
def node_token(node_id: str) -> str:
    """`<ntok>`: node ids are hostnames or Ray node ids and may hold dots."""
    return _token(node_id, node_id)


def node_subject(node_id: str) -> str:
    return f"{NODE_EVENTS_PREFIX}{node_token(node_id)}"


def node_facts_from(source_token: str) -> str:
    """`ndif.evt.node.<ntok>.<ntok>`: a node's observed facts, as its own agent appends them."""
    return f"{NODE_EVENTS_PREFIX}{source_token}.{source_token}"


def is_fact_subject(subject: str) -> bool:
    """Whether `subject` is an observed fact's in the log (its source token last): such a fact is
    sent to FACTS_STREAM (`fact_inbox`) and reaches the log only through the fact gate."""
    return any(subject_matches(subject, p) for p in FACT_LOG_SUBJECTS)


def fact_inbox(subject: str) -> str:
    """Where a source sends the fact whose subject in the log is `subject` (`ndif.evt.X` -> `ndif.fact.X`)."""
    return FACT_INBOX_PREFIX + subject.removeprefix(EVENTS_PREFIX)


def fact_log_subject(inbox: str) -> str | None:
    """The log subject of a fact sent on `inbox` (None: not a fact inbox subject)."""
    subject = EVENTS_PREFIX + inbox.removeprefix(FACT_INBOX_PREFIX)
    return subject if inbox.startswith(FACT_INBOX_PREFIX) and is_fact_subject(subject) else None


def refused_subject(source_token: str, facts_seq: int | str) -> str:
    """`ndif.refused.<source token>.<facts seq>`: the gate's refusal of the fact at `facts_seq` of
    FACTS_STREAM, sent by that source (`*`: any of its facts, for permissions)."""
    return f"{REFUSED_PREFIX}.{source_token}.{facts_seq}"


def replica_facts_from(source_token: str) -> str:
    """`ndif.evt.replica.*.*.<source>`: observed replica facts of one source (a node's token, or `dispatcher`)."""
    return f"{REPLICA_EVENTS_PREFIX}*.*.{source_token}"


def model_subject(model_key: str) -> str:
    return f"{MODEL_EVENTS_PREFIX}{model_token(model_key)}"


def replica_subject(model_key: str, replica_id: int) -> str:
    return f"{REPLICA_EVENTS_PREFIX}{model_token(model_key)}.{int(replica_id)}"


def command_event_subject(command_id: str) -> str:
    """`ndif.evt.cmd.<ctok>`: a `CommandDecided` of a command about no single model (`evict --all`)."""
    return f"{COMMAND_EVENTS_PREFIX}{_token(command_id, command_id)}"


def replica_call_subject(model_key: str, replica_id: int, node_id: str = "") -> str:
    """`ndif.run.<ntok>.<mtok>.<replica_id>` (core request/reply): the endpoint of a replica on node
    `node_id` for the request path. The node token comes first so that a node's agent (and its
    replicas) may serve its own node's replicas only (`ndif.run.<ntok>.>`, controlplane/ops/auth.py).
    Without a node id: `ndif.run.<mtok>.<replica_id>` (an open server's tests)."""
    if node_id:
        return f"{REPLICA_CALLS_PREFIX}.{node_token(node_id)}.{model_token(model_key)}.{int(replica_id)}"
    return f"{REPLICA_CALLS_PREFIX}.{model_token(model_key)}.{int(replica_id)}"


def node_run_subjects(node_id: str) -> str:
    """The replica endpoints of one node: what its agent's user may subscribe to."""
    return f"{REPLICA_CALLS_PREFIX}.{node_token(node_id)}.>"


def replica_logs_subject(node_id: str, model_key: str, replica_id: int) -> str:
    """`ndif.logs.<ntok>.<mtok>.<replica_id>` (core request/reply): ask the agent of node `node_id`
    for the replica's recent log lines (schemas/logs.py). Only the admin may publish here."""
    return f"{REPLICA_LOGS_PREFIX}.{node_token(node_id)}.{model_token(model_key)}.{int(replica_id)}"


def node_logs_subjects(node_id: str) -> str:
    """`ndif.logs.<ntok>.>`: what one node's agent answers (and its account exports to the system's)."""
    return f"{REPLICA_LOGS_PREFIX}.{node_token(node_id)}.>"


def figures_subject(model_key: str) -> str:
    """`ndif.figures.<mtok>`: where dispatchers publish a model's queue figures."""
    return f"{FIGURES_PREFIX}.{model_token(model_key)}"


def model_events_filter(model_key: str) -> list[str]:
    """Subject filters that select every event of one model (model-level and replica-level)."""
    tok = model_token(model_key)
    return [f"{MODEL_EVENTS_PREFIX}{tok}", f"{REPLICA_EVENTS_PREFIX}{tok}.>"]


def replica_events_filter(model_key: str, replica_id: int) -> list[str]:
    """Subject filters that select every event of one replica: its decisions, and its observed facts
    (which carry their source as a last token)."""
    base = replica_subject(model_key, replica_id)
    return [base, f"{base}.*"]


def request_subject(model_key: str, user: str = "") -> str:
    """`ndif.req.<mtok>.<user>`; `ndif.req.<mtok>` without a user (an open server).

    The user token is the client's user name, which the server's permissions make it publish
    under: the dispatcher takes a request's owner from this subject, never from the body.
    """
    tok = model_token(model_key)
    return f"{REQUESTS_PREFIX}.{tok}.{user}" if user else f"{REQUESTS_PREFIX}.{tok}"


_MODEL_TOKEN = re.compile(rf"^[A-Za-z0-9_-]{{1,{_SLUG_MAX}}}-[0-9a-f]{{10}}$")


def valid_model_token(token: str) -> bool:
    """Whether a subject's model token is one `model_token` makes. NATS delivers a publish on
    `ndif.req.*.alice` literally, and `*` (or `>`) used as a token in a filter would read every
    model's requests."""
    return _MODEL_TOKEN.match(token) is not None


def request_consumer(model_tok: str, partition: int | None = None) -> str:
    """A durable consumer of a model's requests: `part<k>-<mtok>` for user partition k, `proc-<mtok>`
    for the userless ones and those stored unpartitioned."""
    if partition is None:
        return f"{REQUEST_CONSUMER_PREFIX}{model_tok}"
    return f"{REQUEST_PARTITION_CONSUMER_PREFIX}{partition}-{model_tok}"


_PARTITION_CONSUMER = re.compile(rf"^{REQUEST_PARTITION_CONSUMER_PREFIX}([0-9]{{1,2}})-(.+)$")


def request_consumer_token(name: str) -> str | None:
    """The model token of a request consumer's name (either kind); None for any other consumer."""
    if name.startswith(REQUEST_CONSUMER_PREFIX):
        return name[len(REQUEST_CONSUMER_PREFIX):]
    m = _PARTITION_CONSUMER.match(name)
    return m.group(2) if m and int(m.group(1)) < REQUEST_PARTITIONS else None


def request_consumer_partition(name: str) -> int | None:
    """The user partition a request consumer reads (`part<k>-<mtok>`: k); None for `proc-<mtok>`
    (userless requests, and those stored unpartitioned) and any other name."""
    m = _PARTITION_CONSUMER.match(name)
    return int(m.group(1)) if m and int(m.group(1)) < REQUEST_PARTITIONS else None


def request_consumers(model_tok: str) -> dict[str, list[str]]:
    """Every durable consumer of one model's requests, name -> its filter subjects: the userless and
    unpartitioned ones first, then each partition's. Their filters do not overlap (a work queue's may not)."""
    out = {request_consumer(model_tok): [f"{REQUESTS_PREFIX}.{model_tok}", f"{REQUESTS_PREFIX}.{model_tok}.*"]}
    for k in range(REQUEST_PARTITIONS):
        out[request_consumer(model_tok, k)] = [f"{REQUESTS_PREFIX}.{model_tok}.*.{k}"]
    return out


def request_filters(model_tok: str) -> list[str]:
    """The subjects of one model's stored requests, by its token, read side by side (by subject,
    no consumer): userless (an open server), each user partition's (`ndif.req.<mtok>.*.<k>`, so one
    user's pile is not read ahead of another's first request), and every user subject (`.>`: also
    the tails no consumer takes). `consumed_request_subject` says which of them a consumer takes."""
    return ([f"{REQUESTS_PREFIX}.{model_tok}"]
            + [f"{REQUESTS_PREFIX}.{model_tok}.*.{k}" for k in range(REQUEST_PARTITIONS)]
            + [f"{REQUESTS_PREFIX}.{model_tok}.>"])


def consumed_request_subject(subject: str) -> bool:
    """Whether one of its model's consumers takes a stored request subject: `ndif.req.<mtok>`,
    `ndif.req.<mtok>.<user>` or `ndif.req.<mtok>.<user>.<k>` (k a partition). On an open server
    anyone may publish, say, `ndif.req.<mtok>.a.b.c`, which nothing would ever take."""
    parts = subject.split(".")
    if len(parts) == 5:
        return parts[4] in _PARTITION_TOKENS  # `5`, never `05` or a digit of another script
    return len(parts) in (3, 4)


_PARTITION_TOKENS = frozenset(str(k) for k in range(REQUEST_PARTITIONS))


@functools.lru_cache(maxsize=4096)
def request_partition(user: str) -> int:
    """The partition the request stream's subject transform gives `user` (nats-server's
    `partition()`: FNV-1a 32 of the token, mod REQUEST_PARTITIONS)."""
    h = 0x811C9DC5
    for b in user.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h % REQUEST_PARTITIONS


def stored_request_subject(subject: str) -> str:
    """The subject the request stream stores a request published on `subject` under (the transform)."""
    parts = subject.split(".")
    return f"{subject}.{request_partition(parts[3])}" if len(parts) == 4 else subject


def user_requests(user: str) -> str:
    """`ndif.req.*.<user>`: every request a user may publish."""
    return f"{REQUESTS_PREFIX}.*.{user}"


def user_statuses(user: str) -> str:
    """`ndif.status.<user>.>`: every status of one user's requests."""
    return f"{STATUS_PREFIX}.{user}.>"


def kill_subject(user: str = "") -> str:
    """`ndif.dispatcher.kill.<user>` (a user's kill of their own request), `ndif.dispatcher.kill` (an admin's)."""
    return f"{DISPATCHER_KILL}.{user}" if user else DISPATCHER_KILL


def subject_matches(subject: str, pattern: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    s, p = subject.split("."), pattern.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(s) == len(p)


def request_subject_parts(subject: str) -> tuple[str, str]:
    """(model token, user) of a request subject, as published or as stored (`.<partition>` last;
    user "" for the userless form)."""
    parts = subject.split(".")
    return (parts[2] if len(parts) > 2 else ""), (parts[3] if len(parts) > 3 else "")


def status_key(request_id: str, user: str = "") -> str:
    """A request's key in KV `ndif_request_status`: `<user>.<request_id>` (or the id alone, without a user)."""
    return f"{user}.{request_id}" if user else request_id


def results_bucket(user: str = "") -> str:
    """The Object Store bucket of one user's large results: `ndif_results_<user>` (`ndif_results`
    without a user). One bucket (one stream, `OBJ_ndif_results_<user>`) per user, so the server's
    permissions give each client read access to its own results only (controlplane/ops/auth.py)."""
    return f"{RESULTS_BUCKET}_{user}" if user else RESULTS_BUCKET


def command_subject(verb: str) -> str:
    return f"{COMMANDS_PREFIX}.{verb}"


def status_subject(request_id: str, user: str = "") -> str:
    """`ndif.status.<user>.<request_id>` (request ids and user names are one subject token each:
    [A-Za-z0-9_-]); `ndif.status.<request_id>` without a user. A client may subscribe to its own
    user's statuses only.

    It is also where the server republishes the request's key of KV `ndif_request_status` as it
    is stored (`$KV.ndif_request_status.>` -> `ndif.status.>`), so the two must stay the same.
    """
    return f"{STATUS_PREFIX}.{status_key(request_id, user)}"


def operator_filters(model_key: str | None = None, replica_id: int | None = None,
                     node_id: str | None = None) -> dict[str, str]:
    """The subject filters an operator types into `nats stream view` / `nats sub` (docs/nats-cli.md)."""
    out: dict[str, str] = {}
    if model_key is not None:
        tok = model_token(model_key)
        out["model events"] = f"{MODEL_EVENTS_PREFIX}{tok}"
        if replica_id is None:
            out["replica events"] = f"{REPLICA_EVENTS_PREFIX}{tok}.>"
        else:  # decisions on the replica's subject, observed facts one token deeper (their source)
            out["replica decisions"] = replica_subject(model_key, replica_id)
            out["replica facts"] = f"{replica_subject(model_key, replica_id)}.*"
        out["requests"] = request_subject(model_key)  # an open server's (no users)
        out["user requests"] = f"{request_subject(model_key)}.>"  # every user's, stored `ndif.req.<mtok>.<user>.<k>`
    if node_id is not None:
        out["node events"] = node_subject(node_id)  # NodeLost (and NodeJoined stored before facts carried a source)
        out["node facts"] = node_facts_from(node_token(node_id))
        out["heartbeat key"] = f"{node_token(node_id)} (bucket {HEARTBEATS_BUCKET})"
    return out
