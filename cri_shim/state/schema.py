"""Schema migrations, applied in order; `PRAGMA user_version` holds how many have run.

Append a new script to change the schema; never edit one that has shipped.
"""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: the first schema.
    """
    CREATE TABLE names (
        name        TEXT PRIMARY KEY,
        kind        TEXT NOT NULL,          -- sandbox | container
        object_id   TEXT NOT NULL UNIQUE,
        reserved_at REAL NOT NULL
    );
    CREATE TABLE sandboxes (
        id              TEXT PRIMARY KEY,
        name            TEXT NOT NULL UNIQUE,
        phase           TEXT NOT NULL,      -- creating | cached | visible
        stage           TEXT NOT NULL,
        state           TEXT NOT NULL,      -- ready | notready
        created_at      INTEGER NOT NULL,   -- nanoseconds since the epoch
        runtime_handler TEXT NOT NULL,
        config          BLOB NOT NULL,      -- runtime.v1.PodSandboxConfig, serialized
        sandbox_dir     TEXT NOT NULL,
        netns_path      TEXT,
        ipc_path        TEXT,
        uts_path        TEXT,
        ips             TEXT NOT NULL DEFAULT '[]',
        cni_result      TEXT,
        cached_until    REAL
    );
    CREATE TABLE containers (
        id            TEXT PRIMARY KEY,
        name          TEXT NOT NULL UNIQUE,
        sandbox_id    TEXT NOT NULL,
        phase         TEXT NOT NULL,        -- creating | cached | visible
        stage         TEXT NOT NULL,
        state         TEXT NOT NULL,        -- created | running | exited | unknown
        created_at    INTEGER NOT NULL,
        started_at    INTEGER NOT NULL DEFAULT 0,
        finished_at   INTEGER NOT NULL DEFAULT 0,
        exit_code     INTEGER NOT NULL DEFAULT 0,
        reason        TEXT NOT NULL DEFAULT '',
        message       TEXT NOT NULL DEFAULT '',
        image_id      TEXT NOT NULL DEFAULT '',
        image_ref     TEXT NOT NULL DEFAULT '',
        config        BLOB NOT NULL,        -- runtime.v1.ContainerConfig, serialized
        log_path      TEXT NOT NULL DEFAULT '',
        bundle_dir    TEXT NOT NULL DEFAULT '',
        rootfs        TEXT NOT NULL DEFAULT '',
        pid           INTEGER NOT NULL DEFAULT 0,
        cached_until  REAL
    );
    CREATE INDEX containers_by_sandbox ON containers (sandbox_id);
    CREATE TABLE images (
        id              TEXT PRIMARY KEY,   -- sha256:<config digest>
        repo_tags       TEXT NOT NULL DEFAULT '[]',
        repo_digests    TEXT NOT NULL DEFAULT '[]',
        size            INTEGER NOT NULL DEFAULT 0,
        manifest_digest TEXT NOT NULL DEFAULT '',
        config          TEXT NOT NULL,      -- the OCI image config JSON
        layers          TEXT NOT NULL DEFAULT '[]',  -- chain IDs, bottom first
        created_at      INTEGER NOT NULL
    );
    CREATE TABLE layers (
        chain_id     TEXT PRIMARY KEY,
        diff_id      TEXT NOT NULL,
        parent       TEXT,
        path         TEXT NOT NULL,
        size         INTEGER NOT NULL DEFAULT 0,
        created_at   INTEGER NOT NULL
    );
    -- The undo journal (DESIGN 2): each step once done records its inverse here, before
    -- the next step starts. Cleanup runs an object's rows backwards by seq.
    CREATE TABLE journal (
        object_id TEXT NOT NULL,
        seq       INTEGER NOT NULL,
        action    TEXT NOT NULL,
        args      TEXT NOT NULL,
        PRIMARY KEY (object_id, seq)
    );
    -- The allocation ledger (DESIGN 4): what was handed out, to whom, until its teardown ran.
    CREATE TABLE allocations (
        kind         TEXT NOT NULL,         -- ip | netns | path | port | cgroup
        value        TEXT NOT NULL,
        owner_id     TEXT NOT NULL,
        allocated_at REAL NOT NULL,
        PRIMARY KEY (kind, value)
    );
    CREATE INDEX allocations_by_owner ON allocations (owner_id);
    -- Undo steps that still failed after their retries, for background garbage collection.
    CREATE TABLE gc_queue (
        id        INTEGER PRIMARY KEY AUTOINCREMENT,
        object_id TEXT NOT NULL,
        action    TEXT NOT NULL,
        args      TEXT NOT NULL,
        error     TEXT NOT NULL,
        attempts  INTEGER NOT NULL DEFAULT 0,
        queued_at REAL NOT NULL
    )
    """,
    # 2: containers remember their image's layers, so that removing the image cannot
    # delete layer directories under a live overlay.
    """
    ALTER TABLE containers ADD COLUMN layers TEXT NOT NULL DEFAULT '[]'
    """,
    # 3: a pod with a user namespace of its own pins it like its other namespaces.
    """
    ALTER TABLE sandboxes ADD COLUMN userns_path TEXT
    """,
    # 4: a container's image as a repository digest reference (`name@sha256:…`), what
    # ContainerStatus reports as `image_ref`; `image_ref` holds the name as the user gave it.
    """
    ALTER TABLE containers ADD COLUMN repo_digest TEXT NOT NULL DEFAULT ''
    """,
    # 5: the phase of an object being created is called as the creation coordinator
    # calls it (`in_flight`, where the first schema said `creating`).
    """
    UPDATE sandboxes SET phase = 'in_flight' WHERE phase = 'creating';
    UPDATE containers SET phase = 'in_flight' WHERE phase = 'creating'
    """,
    # 6: who a container's process runs as (the OCI spec's process.user, as JSON), which
    # ContainerStatus reports: read from the row, not from the bundle's config.json.
    """
    ALTER TABLE containers ADD COLUMN process_user TEXT NOT NULL DEFAULT ''
    """,
]
