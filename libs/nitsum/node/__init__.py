"""The node runtime: one node world, its topology and epochs, TP/role transitions, KV paths, runner pool.

Built on `nitsum.engine` (which imports nothing from here). Importing the package is cheap; torch loads
only when a module below is imported.

One worker's share of a node whose TP groups change at run time: Prepare / Commit / Abort with epochs.

`NodeRuntime` (runtime.py) wraps what this worker is in the current topology: the *leader* of its group (lowest rank:
it owns an `Engine`, batches, samples and drives its peers through the msgpack step plan) or a *peer*
(it runs the plans its leader broadcasts). A topology command reaches every worker of the group at the
same step boundary: the leader gets it (from the coordinator), broadcasts it as a control plan, and every
member applies it (`NodeRuntime.command` on the leader, `follow` on peers).

Transition (ALGORITHMS.md §1.4), with `span` = this worker's *component* of the change: the largest changed
group (old or new) that holds it (`kv.reshard.component_of`). Components share no worker, KV or request, so each
runs the steps below inside its own group (2xTP2 -> 4xTP1: two splits, neither waits for the other):
- `prepare(epoch, new)`: each changed worker takes a KV cache for its new head slice -- in shm mode a view of
  its spare arena (`shm.Arena`: two per worker, reserved at boot; commit makes the old cache's arena
  the spare), else a fresh one; the span all-gathers the old leaders' block tables; every worker computes the
  same `plan_prepare` (the full blocks to move). The new runner comes from the worker's pool: one runner per
  allowed level (weight *views* of the boot store: no weight is read or allocated), built at boot
  (`_build_ahead`); a change that finds none builds it in a thread, and a fresh segment's pages are reserved
  there, paced, and on past the commit.
  KV paths are agreed once, at construction (`kv_hosts`): every worker all-gathers its host id
  (NITSUM_HOST_ID, else hostname + boot id + its /dev/shm's device), whether it can use /dev/shm, and where
  its KV receiver listens; then each (source, destination) pair has a path.
  One-sided mode (CPU; "auto" picks it): the full blocks move in chunks *between the old groups' decode
  steps* (`precopy.py`; each old group's leader drives its members with `precopy` control plans), written
  into each destination's new cache with no receive posted by its step thread:
  - pairs on one host ("shm"): the new cache lives in shared memory that every source of the host maps (a
    spare arena through /proc/<pid>/fd, or a fresh segment whose name is unlinked before prepare returns)
    and writes into;
  - pairs across hosts ("tcp"): the source connects to the destination's KV receiver in prepare (stage-M
    DSCP; a pair that cannot connect refuses the prepare on every member) and sends each chunk over the
    transfer framing; the receiver's thread writes it into the new cache and acks after the write
    (`nitsum.transfer.kv_tcp`). Forced for every pair by kv_path "tcp".
  The prepare ack is then `pending`; the final one comes when the group's chunks are done and this
  worker's runner is built (`take_prepare_ack`); a chunk whose link failed fails that ack and the commit.
  KV path "p2p" (GPU caches, or configured): the runner is awaited and paired gloo send/recv moves every
  full block inside the prepare step. A failure anywhere (e.g. no memory for the new cache)
  makes every worker ack `ok=False` and keep nothing: the old topology keeps serving; Abort then is a no-op.
  (A peer whose runner build fails is known to its leader only at commit: the commit exchange carries it
  and every worker then keeps the old topology.)
- `commit(epoch)` at a step boundary: each worker finishes whatever pre-copy of its own is left, old
  leaders export their requests' full state, the span all-gathers it, every worker computes `plan_commit`
  (the delta: blocks written since prepare, requests that arrived or were preempted since) and moves it
  (one-sided: shared-memory writes and acked TCP chunks, then an exchange that passes only once every
  source's bytes are written; a failed link there makes every worker keep the old topology); new leaders
  adopt the requests into fresh engines; roles switch. This is the only pause a stream sees. What the old
  topology used is released after it, off the step thread: the old cache and the mappings by the reaper
  (`reaper.py`), the old runner back into the pool.
- `abort(epoch)`: drops the prepared state (new caches, views, mappings, TCP links and the receiver's
  session); the old topology never stopped.
Epochs only grow: a command with an epoch at or below the committed one is refused (as is a commit of
an epoch that was not prepared).

Workers outside the span take no part in the collectives; they only advance their epoch and topology.

Roles: the prepare carries each new group's role (prefill, decode or hybrid) and its leader's worker id; at
commit every worker takes them (the roles ride in `NodeRuntime.topology`, the ids in `leaders`) and every
leader's engine switches to its group's role -- also when only roles change (every worker is then outside the
span, and no KV moves: reshard planning compares groups by span). A prefill engine pins a
request at its first token; the worker shell then hands it to a decode group of the world (handoff.py): the
decode leader reserves blocks, every member of the prefill group writes its heads of the request's blocks into
the decode members' arenas (the one-sided copy a commit's delta uses), and the decode leader adopts it.
The pieces, one job each: the topology commands and which epoch each may act on (commands.py), `Transition`
(one per epoch: its phases and state; transition.py) and its commit's switch (switch.py), one `KvPath` class
per KV mode (kv_paths.py), P/D hand-offs between groups (handoff.py), the `PreCopyGate` of a prepare (gate.py),
the `RunnerPool` (runners.py), the `KvArenas` (arenas.py), the `CacheLayout` (layout.py), the fall-back to TP=1
after a peer loss (fallback.py) and a worker's world and boot weights (boot.py). Node-world messages are
`nitsum.wire.node`.
"""
