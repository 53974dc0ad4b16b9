/* The table under one compiled shard (included by indexer/_shard.c only): its layout, the key table, the
 * key LRU, the holder arrays, the per-entry logs, and the store, removal, clear and eviction of keys.
 *
 * Nothing here calls into Python, so all of it may run with the GIL released: failures are recorded in
 * `failure` and lookup tuples that a write makes stale are queued in `garbage` (a pointer kept, never
 * used), both settled by _shard.c with the GIL. See _shard.c for the layout's rationale.
 */
#ifndef KVINDEX_SHARD_TABLE_H
#define KVINDEX_SHARD_TABLE_H

#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NIL UINT32_MAX
/* shard.py's MAX_COPIES: a pair's copies are counted up to this. */
#define MAX_COPIES 256
/* A store step of at least this many keys runs without the GIL (decoding and the event loop go on on
 * the other core); below it, dropping and re-taking the GIL costs more than it lets others do: each drop
 * hands the GIL to the subscriber thread, which the worker then waits to get back. benchmarks.ingest,
 * 100 pods x 10k blocks (128-key steps), 3 runs each: 1.75-1.86M blocks/s at 64, 2.25-2.55M at 4096. */
#define RELEASE_GIL_KEYS 4096
enum {
    FAILED_NOTHING = 0,
    FAILED_NO_MEMORY,
    FAILED_TOO_MANY_KEYS,
    FAILED_ENTRY_RANGE,
    FAILED_LOG_TOO_LONG,
};
/* The step kinds and counter indices of indexer/shard.py (STORE .. CLEAR, _STORED .. _RELEASED). */
enum { STEP_STORE = 0, STEP_REMOVE = 1, STEP_CHECK_PARENT = 2, STEP_CLEAR = 3 };
enum {
    C_STORED,
    C_REFRESHED,
    C_REMOVED,
    C_MISSING,
    C_CLEARED,
    C_UNKNOWN_PARENT,
    C_EVICTED_KEYS,
    C_EVICTED_ENTRIES,
    C_RELEASED,
    NUM_COUNTS
};

typedef struct {
    uint32_t entry;
    uint32_t copies;
} Item;

/* The holders of a key held by >= 2 entries, or by one entry with >= 2 copies; oldest first. */
typedef struct {
    uint32_t len;
    uint32_t cap;
    PyObject *ids; /* the lookup answer (a tuple of the entry ids), made on first read, dropped on write */
    Item items[];
} Multi;

typedef struct {
    uint64_t key;
    uint32_t prev; /* key LRU: towards the least recently stored */
    uint32_t next; /* key LRU: towards the most recently stored; the free list's link for free nodes */
    uintptr_t holder;
} Node;

typedef struct {
    uint64_t *keys; /* NULL: no log (shard.py: no entry_keys item) */
    uint32_t len;
    uint32_t cap;
} Log;

/* How many recently made holder tuples a shard keeps for reuse (a power of two). */
#define RECENT_IDS 64

typedef struct {
    PyObject_HEAD
    /* key table: slots hold node number + 1 (0 = empty) */
    uint32_t *slots;
    uint64_t mask;
    int shift;
    /* nodes */
    Node *nodes;
    uint32_t nodes_len; /* nodes ever handed out (free ones included) */
    uint32_t nodes_cap;
    uint32_t free_head;
    uint32_t head; /* least recently stored key */
    uint32_t tail;
    uint32_t count; /* keys held */
    /* per entry id */
    int64_t *live;
    Log *logs;
    uint32_t entries_cap;
    /* references dropped while the GIL may be released, released at the end of the call */
    PyObject **garbage;
    size_t garbage_len;
    size_t garbage_cap;
    int failure; /* FAILED_*: what went wrong on a path that may run without the GIL */
    /* The holder tuples made most recently, by a hash of their ids: a new answer equal to one of them is
     * that tuple (see multi_ids). */
    PyObject *recent_ids[RECENT_IDS];
    /* caps */
    Py_ssize_t capacity;
    Py_ssize_t low_water;
    Py_ssize_t max_pods_per_key;
} ShardObject;

#define IS_SINGLE(holder) ((holder) & 1u)
#define SINGLE(entry) ((((uintptr_t)(entry)) << 1) | 1u)
#define SINGLE_ENTRY(holder) ((uint32_t)((holder) >> 1))
#define MULTI(holder) ((Multi *)(holder))

/* ---- key table ---- */

static inline uint64_t
home_of(const ShardObject *self, uint64_t key)
{
    /* Fibonacci hashing: block keys are hashes already, but tests and sims use small sequential ints. */
    return (key * 0x9E3779B97F4A7C15ULL) >> self->shift;
}

/* The slot holding `key`, or the empty slot where it would go; sets *node to its node or NIL. */
static inline uint64_t
find_slot(const ShardObject *self, uint64_t key, uint32_t *node)
{
    uint64_t i = home_of(self, key);
    for (;;) {
        uint32_t slot = self->slots[i];
        if (slot == 0) {
            *node = NIL;
            return i;
        }
        if (self->nodes[slot - 1].key == key) {
            *node = slot - 1;
            return i;
        }
        i = (i + 1) & self->mask;
    }
}

static inline uint32_t
find_node(const ShardObject *self, uint64_t key)
{
    uint32_t node;
    find_slot(self, key, &node);
    return node;
}

/* A batch's keys are known ahead: ask for the slot of the key PREFETCH_AHEAD places on, and for the node
 * of the one half as far on (its slot has arrived by then), so the table's cache misses overlap instead
 * of stalling one key at a time (the index outgrows the caches at a few hundred thousand keys). */
#define PREFETCH_AHEAD 8

static inline void
prefetch_slot(const ShardObject *self, uint64_t key)
{
    __builtin_prefetch(&self->slots[home_of(self, key)]);
}

static inline void
prefetch_node(const ShardObject *self, uint64_t key)
{
    uint32_t slot = self->slots[home_of(self, key)];
    if (slot) {
        __builtin_prefetch(&self->nodes[slot - 1]);
    }
}

static inline void
prefetch_ahead(const ShardObject *self, const uint64_t *keys, Py_ssize_t i, Py_ssize_t count)
{
    if (i + PREFETCH_AHEAD < count) {
        prefetch_slot(self, keys[i + PREFETCH_AHEAD]);
    }
    if (i + PREFETCH_AHEAD / 2 < count) {
        prefetch_node(self, keys[i + PREFETCH_AHEAD / 2]);
    }
}

static int
table_resize(ShardObject *self, int bits)
{
    uint64_t size = (uint64_t)1 << bits;
    uint32_t *slots = calloc(size, sizeof(uint32_t));
    uint32_t *old = self->slots;
    uint64_t old_size = old ? self->mask + 1 : 0;
    if (slots == NULL) {
        self->failure = FAILED_NO_MEMORY;
        return -1;
    }
    self->slots = slots;
    self->mask = size - 1;
    self->shift = 64 - bits;
    /* Rehashed in node order (a sequential read; free nodes have holder 0), not slot order, which would
     * read the nodes at random. */
    for (uint32_t n = 0; old_size && n < self->nodes_len; n++) {
        if (n + PREFETCH_AHEAD < self->nodes_len) {
            prefetch_slot(self, self->nodes[n + PREFETCH_AHEAD].key);
        }
        if (self->nodes[n].holder) {
            uint64_t i = home_of(self, self->nodes[n].key);
            while (slots[i]) {
                i = (i + 1) & self->mask;
            }
            slots[i] = n + 1;
        }
    }
    free(old);
    return 0;
}

/* Empty slot i, moving later members of its probe run back so that no lookup stops short. */
static void
table_erase_slot(ShardObject *self, uint64_t i)
{
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & self->mask;
        uint32_t slot = self->slots[j];
        if (slot == 0) {
            break;
        }
        uint64_t k = home_of(self, self->nodes[slot - 1].key);
        /* The member at j may fill i unless its home lies cyclically in (i, j]. */
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            self->slots[i] = slot;
            i = j;
        }
    }
    self->slots[i] = 0;
}

/* ---- nodes and the key LRU ---- */

static inline void
lru_unlink(ShardObject *self, uint32_t n)
{
    Node *node = &self->nodes[n];
    if (node->prev != NIL) {
        self->nodes[node->prev].next = node->next;
    }
    else {
        self->head = node->next;
    }
    if (node->next != NIL) {
        self->nodes[node->next].prev = node->prev;
    }
    else {
        self->tail = node->prev;
    }
}

static inline void
lru_push_tail(ShardObject *self, uint32_t n)
{
    Node *node = &self->nodes[n];
    node->prev = self->tail;
    node->next = NIL;
    if (self->tail != NIL) {
        self->nodes[self->tail].next = n;
    }
    else {
        self->head = n;
    }
    self->tail = n;
}

/* A new newest key with these holders; -1 on memory exhaustion (nothing changed). */
static int
key_insert(ShardObject *self, uint64_t key, uint64_t slot, uintptr_t holder)
{
    uint32_t n;
    if ((uint64_t)(self->count + 1) * 10 > (self->mask + 1) * 7) {
        int bits = 64 - self->shift + 1;
        if (table_resize(self, bits) < 0) {
            return -1;
        }
        uint32_t absent;
        slot = find_slot(self, key, &absent);
    }
    if (self->free_head != NIL) {
        n = self->free_head;
        self->free_head = self->nodes[n].next;
    }
    else {
        if (self->nodes_len == self->nodes_cap) {
            uint32_t cap = self->nodes_cap ? self->nodes_cap * 2 : 64;
            Node *nodes;
            if (self->nodes_cap >= (NIL - 1) / 2) {
                self->failure = FAILED_TOO_MANY_KEYS;
                return -1;
            }
            nodes = realloc(self->nodes, (size_t)cap * sizeof(Node));
            if (nodes == NULL) {
                self->failure = FAILED_NO_MEMORY;
                return -1;
            }
            self->nodes = nodes;
            self->nodes_cap = cap;
        }
        n = self->nodes_len++;
    }
    self->nodes[n].key = key;
    self->nodes[n].holder = holder;
    lru_push_tail(self, n);
    self->slots[slot] = n + 1;
    self->count++;
    return 0;
}

/* Drop a reference later, with the GIL (see the top of the file). */
static void
drop_later(ShardObject *self, PyObject *object)
{
    if (self->garbage_len == self->garbage_cap) {
        size_t cap = self->garbage_cap ? self->garbage_cap * 2 : 64;
        PyObject **grown = realloc(self->garbage, cap * sizeof(PyObject *));
        if (grown == NULL) {
            self->failure = FAILED_NO_MEMORY; /* and the object leaks: nothing else can be done here */
            return;
        }
        self->garbage = grown;
        self->garbage_cap = cap;
    }
    self->garbage[self->garbage_len++] = object;
}

static void
multi_free(ShardObject *self, Multi *multi)
{
    if (multi->ids != NULL) {
        drop_later(self, multi->ids);
    }
    free(multi);
}

/* Drop a key (its holders are the caller's to account for and free). */
static void
key_erase(ShardObject *self, uint64_t slot, uint32_t n)
{
    table_erase_slot(self, slot);
    lru_unlink(self, n);
    self->nodes[n].holder = 0;
    self->nodes[n].next = self->free_head;
    self->free_head = n;
    self->count--;
}

static void
key_erase_node(ShardObject *self, uint32_t n)
{
    uint32_t found;
    uint64_t slot = find_slot(self, self->nodes[n].key, &found);
    key_erase(self, slot, n);
}

/* ---- holder arrays ---- */

static Multi *
multi_new(ShardObject *self, uint32_t cap)
{
    Multi *multi = malloc(sizeof(Multi) + (size_t)cap * sizeof(Item));
    if (multi == NULL) {
        self->failure = FAILED_NO_MEMORY;
        return NULL;
    }
    multi->len = 0;
    multi->cap = cap;
    multi->ids = NULL;
    return multi;
}

/* Room for one more item; the array may move (*slot is updated). */
static int
multi_reserve(ShardObject *self, uintptr_t *slot)
{
    Multi *multi = MULTI(*slot);
    if (multi->len < multi->cap) {
        return 0;
    }
    uint32_t cap = multi->cap * 2;
    Multi *grown = realloc(multi, sizeof(Multi) + (size_t)cap * sizeof(Item));
    if (grown == NULL) {
        self->failure = FAILED_NO_MEMORY;
        return -1;
    }
    grown->cap = cap;
    *slot = (uintptr_t)grown;
    return 0;
}

static inline int
multi_find(const Multi *multi, uint32_t entry)
{
    for (uint32_t i = 0; i < multi->len; i++) {
        if (multi->items[i].entry == entry) {
            return (int)i;
        }
    }
    return -1;
}

static inline void
multi_delete(Multi *multi, uint32_t i)
{
    memmove(&multi->items[i], &multi->items[i + 1], (multi->len - i - 1) * sizeof(Item));
    multi->len--;
}

/* A write to the key: its cached lookup answer goes. */
static inline void
multi_touch(ShardObject *self, Multi *multi)
{
    if (multi->ids != NULL) {
        drop_later(self, multi->ids);
        multi->ids = NULL;
    }
}

/* shard.py's _fold: after a pair lost copies, one entry with one copy goes back to the tagged word. */
static void
fold(ShardObject *self, uint32_t n)
{
    Multi *multi = MULTI(self->nodes[n].holder);
    if (multi->len > 1) {
        return;
    }
    if (multi->len == 0) {
        multi_free(self, multi);
        key_erase_node(self, n);
        return;
    }
    if (multi->items[0].copies == 1) {
        self->nodes[n].holder = SINGLE(multi->items[0].entry);
        multi_free(self, multi);
    }
}

/* ---- per entry ---- */

static int
entries_reserve(ShardObject *self, uint64_t entry)
{
    if (entry < self->entries_cap) {
        return 0;
    }
    if (entry >= (uint64_t)INT32_MAX) {
        self->failure = FAILED_ENTRY_RANGE;
        return -1;
    }
    uint32_t cap = self->entries_cap ? self->entries_cap : 8;
    while (cap <= entry) {
        cap *= 2;
    }
    int64_t *live = realloc(self->live, (size_t)cap * sizeof(int64_t));
    if (live == NULL) {
        self->failure = FAILED_NO_MEMORY;
        return -1;
    }
    self->live = live;
    Log *logs = realloc(self->logs, (size_t)cap * sizeof(Log));
    if (logs == NULL) {
        self->failure = FAILED_NO_MEMORY;
        return -1;
    }
    self->logs = logs;
    memset(&live[self->entries_cap], 0, (cap - self->entries_cap) * sizeof(int64_t));
    memset(&logs[self->entries_cap], 0, (cap - self->entries_cap) * sizeof(Log));
    self->entries_cap = cap;
    return 0;
}

static int
log_extend(ShardObject *self, Log *log, const uint64_t *keys, Py_ssize_t count)
{
    if ((uint64_t)log->len + (uint64_t)count > UINT32_MAX) {
        self->failure = FAILED_LOG_TOO_LONG;
        return -1;
    }
    uint32_t need = log->len + (uint32_t)count;
    if (log->keys == NULL || need > log->cap) {
        uint32_t cap = log->cap ? log->cap : 16;
        while (cap < need) {
            cap = cap > UINT32_MAX / 2 ? UINT32_MAX : cap * 2;
        }
        uint64_t *grown = realloc(log->keys, (size_t)cap * sizeof(uint64_t));
        if (grown == NULL) {
            self->failure = FAILED_NO_MEMORY;
            return -1;
        }
        log->keys = grown;
        log->cap = cap;
    }
    memcpy(&log->keys[log->len], keys, (size_t)count * sizeof(uint64_t));
    log->len = need;
    return 0;
}

static void
log_drop(Log *log)
{
    free(log->keys);
    log->keys = NULL;
    log->len = log->cap = 0;
}

static int
holds(const ShardObject *self, uint64_t key, uint32_t entry)
{
    uint32_t n = find_node(self, key);
    if (n == NIL) {
        return 0;
    }
    uintptr_t holder = self->nodes[n].holder;
    if (IS_SINGLE(holder)) {
        return SINGLE_ENTRY(holder) == entry;
    }
    return multi_find(MULTI(holder), entry) >= 0;
}

static int
compare_keys(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Rewrite one entry's log with exactly the keys it holds, each once (order does not matter to readers:
 * a clear drops the same pairs in any order). */
static void
compact(ShardObject *self, uint32_t entry)
{
    Log *log = &self->logs[entry];
    uint32_t kept = 0;
    qsort(log->keys, log->len, sizeof(uint64_t), compare_keys);
    for (uint32_t i = 0; i < log->len; i++) {
        uint64_t key = log->keys[i];
        if (i && key == log->keys[i - 1]) {
            continue;
        }
        if (holds(self, key, entry)) {
            log->keys[kept++] = key;
        }
    }
    log->len = kept;
    if (log->cap > 64 && kept < log->cap / 4) {
        uint32_t cap = kept < 16 ? 16 : kept;
        uint64_t *shrunk = realloc(log->keys, (size_t)cap * sizeof(uint64_t));
        if (shrunk != NULL) {
            log->keys = shrunk;
            log->cap = cap;
        }
    }
}

/* ---- the write path ---- */

/* One key of a store (shard.py's _store_each); -1 on memory exhaustion. */
static int
store_key(ShardObject *self, uint32_t entry, uint64_t key, Py_ssize_t *counts, int64_t *stored)
{
    uint32_t n;
    uint64_t slot = find_slot(self, key, &n);
    if (n == NIL) {
        if (key_insert(self, key, slot, SINGLE(entry)) < 0) {
            return -1;
        }
        (*stored)++;
        return 0;
    }
    Node *node = &self->nodes[n];
    /* A store makes the key the newest in the key LRU. */
    if (self->tail != n) {
        lru_unlink(self, n);
        lru_push_tail(self, n);
    }
    uintptr_t holder = node->holder;
    if (!IS_SINGLE(holder)) {
        Multi *multi = MULTI(holder);
        multi_touch(self, multi);
        int i = multi_find(multi, entry);
        if (i >= 0) {
            /* One more copy, and the entry becomes the newest in this key's LRU. */
            uint32_t copies = multi->items[i].copies;
            multi_delete(multi, (uint32_t)i);
            multi->items[multi->len].entry = entry;
            multi->items[multi->len].copies = copies < MAX_COPIES ? copies + 1 : MAX_COPIES;
            multi->len++;
            counts[C_REFRESHED]++;
            return 0;
        }
        if (multi_reserve(self, &node->holder) < 0) {
            return -1;
        }
        multi = MULTI(node->holder);
        multi->items[multi->len].entry = entry;
        multi->items[multi->len].copies = 1;
        multi->len++;
        (*stored)++;
        if ((Py_ssize_t)multi->len > self->max_pods_per_key) {
            self->live[multi->items[0].entry]--;
            multi_delete(multi, 0);
            counts[C_EVICTED_ENTRIES]++;
            if (multi->len == 1) { /* max_pods_per_key == 1 and a single new copy */
                node->holder = SINGLE(entry);
                multi_free(self, multi);
            }
        }
        return 0;
    }
    uint32_t held = SINGLE_ENTRY(holder);
    if (held == entry) {
        Multi *multi = multi_new(self, 2);
        if (multi == NULL) {
            return -1;
        }
        multi->items[0].entry = entry;
        multi->items[0].copies = 2;
        multi->len = 1;
        node->holder = (uintptr_t)multi;
        counts[C_REFRESHED]++;
    }
    else if (self->max_pods_per_key == 1) {
        self->live[held]--;
        node->holder = SINGLE(entry);
        (*stored)++;
        counts[C_EVICTED_ENTRIES]++;
    }
    else {
        Multi *multi = multi_new(self, 2);
        if (multi == NULL) {
            return -1;
        }
        multi->items[0].entry = held;
        multi->items[0].copies = 1;
        multi->items[1].entry = entry;
        multi->items[1].copies = 1;
        multi->len = 2;
        node->holder = (uintptr_t)multi;
        (*stored)++;
    }
    return 0;
}

/* A full shard drops its least recently stored keys down to low_water. */
static void
evict_oldest_keys(ShardObject *self, Py_ssize_t *counts)
{
    while ((Py_ssize_t)self->count > self->low_water) {
        uint32_t n = self->head;
        uintptr_t holder = self->nodes[n].holder;
        if (IS_SINGLE(holder)) {
            self->live[SINGLE_ENTRY(holder)]--;
            counts[C_EVICTED_ENTRIES]++;
        }
        else {
            Multi *multi = MULTI(holder);
            for (uint32_t i = 0; i < multi->len; i++) {
                self->live[multi->items[i].entry]--;
            }
            counts[C_EVICTED_ENTRIES] += multi->len;
            multi_free(self, multi);
        }
        key_erase_node(self, n);
        counts[C_EVICTED_KEYS]++;
    }
}

/* A group's keys, one by one; may run without the GIL. */
static int
store_keys(ShardObject *self, uint32_t entry, const uint64_t *keys, Py_ssize_t num_keys, Py_ssize_t *counts,
           int64_t *stored)
{
    for (Py_ssize_t i = 0; i < PREFETCH_AHEAD && i < num_keys; i++) {
        prefetch_slot(self, keys[i]);
    }
    for (Py_ssize_t i = 0; i < num_keys; i++) {
        prefetch_ahead(self, keys, i, num_keys);
        if (store_key(self, entry, keys[i], counts, stored) < 0) {
            return -1;
        }
    }
    return 0;
}

/* One copy of a key this entry holds, dropped: the pair goes with its last copy. */
static void
remove_key(ShardObject *self, uint32_t entry, uint64_t key, Py_ssize_t *removed, Py_ssize_t *released)
{
    uint32_t n;
    uint64_t slot = find_slot(self, key, &n);
    if (n == NIL) {
        return;
    }
    uintptr_t holder = self->nodes[n].holder;
    if (IS_SINGLE(holder)) {
        if (SINGLE_ENTRY(holder) == entry) {
            key_erase(self, slot, n);
            (*removed)++;
        }
        return;
    }
    Multi *multi = MULTI(holder);
    int at = multi_find(multi, entry);
    if (at < 0) {
        return;
    }
    multi_touch(self, multi);
    if (multi->items[at].copies > 1) {
        multi->items[at].copies--;
        (*released)++;
    }
    else {
        multi_delete(multi, (uint32_t)at);
        (*removed)++;
    }
    fold(self, n);
}

/* Every pair of one entry (cost: the length of its log); returns the pairs dropped. */
static Py_ssize_t
clear_entry(ShardObject *self, uint32_t entry)
{
    Py_ssize_t cleared = 0;
    if (entry >= self->entries_cap) {
        return 0;
    }
    Log *log = &self->logs[entry];
    self->live[entry] = 0;
    for (uint32_t k = 0; log->keys != NULL && k < log->len; k++) {
        uint32_t n;
        uint64_t slot = find_slot(self, log->keys[k], &n);
        if (n == NIL) {
            continue;
        }
        uintptr_t holder = self->nodes[n].holder;
        if (IS_SINGLE(holder)) {
            if (SINGLE_ENTRY(holder) == entry) {
                key_erase(self, slot, n);
                cleared++;
            }
            continue;
        }
        Multi *multi = MULTI(holder);
        int at = multi_find(multi, entry);
        if (at >= 0) {
            multi_touch(self, multi);
            multi_delete(multi, (uint32_t)at);
            cleared++;
            fold(self, n);
        }
    }
    log_drop(log);
    return cleared;
}

#endif /* KVINDEX_SHARD_TABLE_H */
