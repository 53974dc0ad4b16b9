/* kvindex.indexer._shard: the compiled core of one index shard (the same mechanism as indexer/shard.py).
 *
 * indexer/shard.py's Shard is the reference: this type answers every call with the same result and leaves
 * the same state (tests/indexer/test_shard_cores.py runs both on the same random operations; the
 * conformance suite and the model-based state machine run KVIndex on each). What differs is the layout:
 *
 *   - keys: an open-addressing table (linear probing, backward-shift deletion) of 32-bit node numbers;
 *   - nodes: 24 bytes each, the 64-bit block key, the key-LRU links (least recently stored first) and
 *     the holders, which are one tagged word: (entry id << 1) | 1 while one entry holds the key with one
 *     copy (most keys), else a pointer to a small array of (entry id, copies) in holder-LRU order;
 *   - per entry: the count of pairs it holds here and a log of the keys it stored (a reverse map that
 *     removals and evictions leave stale; compacted once twice the live count, as in shard.py).
 *
 * About 40 bytes per (pod, block) pair for single-holder keys, against ~100 for the dicts of shard.py.
 * The table itself is shard_table.h; this file is the Python type around it: reading the facade's steps
 * and key arrays, the lookup answers, the views and the invariant check.
 *
 * Every method runs with the facade's shard lock taken (indexer/index.py), which is what keeps other
 * threads out: a long store drops the GIL while it works on the table (RELEASE_GIL_KEYS), so code on that
 * path touches no Python object and raises nothing. It records a failure (`failure`) and defers the
 * references it drops (`garbage`) to the end of the call, which raises and releases them with the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shard_table.h"

/* An exact int from 0 to 2**64 - 1 into *out (1), or 0 for any other int; raises nothing. Block keys are
 * 64-bit hashes, three 30-bit digits: PyLong_AsUnsignedLongLong takes those through _PyLong_AsByteArray,
 * ~190 instructions a key (callgrind, 1M keys), a twentieth of ingest's and a score lookup's per-key work;
 * the sign, the bit count and the masked value are ~40. */
static inline int
exact_u64(PyObject *value, uint64_t *out)
{
    if (_PyLong_Sign(value) < 0 || _PyLong_NumBits(value) > 64) {
        return 0;
    }
    *out = PyLong_AsUnsignedLongLongMask(value);
    return 1;
}

/* With the GIL: release what drop_later kept, and raise what a GIL-free path recorded (-1 if so). */
static int
settle(ShardObject *self)
{
    size_t len = self->garbage_len;
    self->garbage_len = 0;
    for (size_t i = 0; i < len; i++) {
        Py_DECREF(self->garbage[i]);
    }
    if (self->failure == FAILED_NOTHING) {
        return 0;
    }
    if (self->failure == FAILED_TOO_MANY_KEYS) {
        PyErr_SetString(PyExc_OverflowError, "shard holds too many keys");
    }
    else if (self->failure == FAILED_ENTRY_RANGE) {
        PyErr_SetString(PyExc_OverflowError, "entry id out of range");
    }
    else if (self->failure == FAILED_LOG_TOO_LONG) {
        PyErr_SetString(PyExc_OverflowError, "an entry's key log is too long");
    }
    else if (!PyErr_Occurred()) {
        PyErr_NoMemory();
    }
    self->failure = FAILED_NOTHING;
    return -1;
}

/* Store the keys logged for `entry` from `start` on (one run at the log's end), then evict and compact.
 * `may_release`: 0 when the caller runs without the GIL already (apply_many). */
static int
store_logged(ShardObject *self, uint32_t entry, uint32_t start, Py_ssize_t *counts, int may_release)
{
    Log *log = &self->logs[entry];
    int64_t stored = 0;
    int status = 0;
    if (may_release && log->len - start >= RELEASE_GIL_KEYS) {
        Py_BEGIN_ALLOW_THREADS
        status = store_keys(self, entry, log->keys + start, log->len - start, counts, &stored);
        Py_END_ALLOW_THREADS
    }
    else if (log->len > start) {
        status = store_keys(self, entry, log->keys + start, log->len - start, counts, &stored);
    }
    self->live[entry] += stored;
    counts[C_STORED] += stored;
    if (may_release && (Py_ssize_t)self->count - self->low_water >= RELEASE_GIL_KEYS &&
        self->count > self->capacity) {
        Py_BEGIN_ALLOW_THREADS
        evict_oldest_keys(self, counts);
        Py_END_ALLOW_THREADS
    }
    else if ((Py_ssize_t)self->count > self->capacity) {
        evict_oldest_keys(self, counts);
    }
    if (log->keys != NULL && (int64_t)log->len > 2 * self->live[entry] + 64) {
        compact(self, entry);
    }
    return status;
}

/* A step's store: each group's keys in order (consecutive events of one entry, merged by the facade). */
static int
store_step(ShardObject *self, uint32_t entry, PyObject *groups, Py_ssize_t *counts)
{
    PyObject *fast = PySequence_Fast(groups, "a store step's key groups must be a sequence");
    int status = 0;
    if (fast == NULL) {
        return -1;
    }
    Log *log = &self->logs[entry];
    uint32_t start = log->len;
    /* Logged whole, group after group (keys this entry already holds just leave a duplicate for
     * compaction): the step's keys are then one run at the log's end, stored from there. */
    for (Py_ssize_t g = 0; g < PySequence_Fast_GET_SIZE(fast) && status == 0; g++) {
        PyObject *group = PySequence_Fast_GET_ITEM(fast, g);
        Py_buffer view;
        if (!PyTuple_Check(group) || PyTuple_GET_SIZE(group) != 2) {
            PyErr_SetString(PyExc_TypeError, "a key group must be (keys, array('Q') of the keys)");
            status = -1;
            break;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(group, 1), &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            status = -1;
            break;
        }
        if (view.itemsize != 8 || view.format == NULL || strcmp(view.format, "Q") != 0) {
            PyErr_SetString(PyExc_TypeError, "a key group's keys must be an array('Q')");
            status = -1;
        }
        else {
            status = log_extend(self, log, view.buf, view.len / 8);
        }
        PyBuffer_Release(&view);
    }
    Py_DECREF(fast);
    if (status < 0) {
        log->len = start; /* nothing of this step was stored */
        return -1;
    }
    return store_logged(self, entry, start, counts, 1);
}

/* One copy of each key dropped for this entry (see remove_step). */
static void
remove_keys(ShardObject *self, uint32_t entry, const uint64_t *keys, Py_ssize_t num_keys, Py_ssize_t *counts)
{
    Py_ssize_t removed = 0, released = 0;
    for (Py_ssize_t i = 0; i < num_keys; i++) {
        remove_key(self, entry, keys[i], &removed, &released);
    }
    counts[C_REMOVED] += removed;
    counts[C_RELEASED] += released;
    counts[C_MISSING] += num_keys - removed - released;
    if (removed) {
        self->live[entry] -= removed;
        if (!self->live[entry]) {
            log_drop(&self->logs[entry]);
        }
    }
}

/* Drop one copy of each key this entry holds (a removal is not a store: nothing moves in either LRU). The
 * keys are all read first: a bad one removes nothing. */
static int
remove_step(ShardObject *self, uint32_t entry, PyObject *keys, Py_ssize_t *counts)
{
    PyObject *fast = PySequence_Fast(keys, "a remove step's keys must be a sequence");
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t num_keys = PySequence_Fast_GET_SIZE(fast);
    uint64_t *buffer = PyMem_Malloc(num_keys ? (size_t)num_keys * sizeof(uint64_t) : 1);
    if (buffer == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < num_keys; i++) {
        buffer[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (buffer[i] == (uint64_t)-1 && PyErr_Occurred()) {
            PyMem_Free(buffer);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    remove_keys(self, entry, buffer, num_keys, counts);
    PyMem_Free(buffer);
    return 0;
}

static PyObject *
entry_object(uint32_t entry)
{
    return PyLong_FromUnsignedLong(entry);
}

static int
as_entry(ShardObject *self, PyObject *obj, uint32_t *entry)
{
    unsigned long value = PyLong_AsUnsignedLong(obj);
    if (value == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (entries_reserve(self, value) < 0) {
        return -1;
    }
    *entry = (uint32_t)value;
    return 0;
}

static Py_ssize_t
clear_entries(ShardObject *self, PyObject *entry_ids)
{
    PyObject *iter = PyObject_GetIter(entry_ids);
    PyObject *item;
    Py_ssize_t cleared = 0;
    if (iter == NULL) {
        return -1;
    }
    while ((item = PyIter_Next(iter)) != NULL) {
        uint32_t entry;
        int status = as_entry(self, item, &entry);
        Py_DECREF(item);
        if (status < 0) {
            Py_DECREF(iter);
            return -1;
        }
        cleared += clear_entry(self, entry);
    }
    Py_DECREF(iter);
    return PyErr_Occurred() ? -1 : cleared;
}

static PyObject *
Shard_clear_entries(ShardObject *self, PyObject *entry_ids)
{
    Py_ssize_t cleared = clear_entries(self, entry_ids);
    if (settle(self) < 0 || cleared < 0) {
        return NULL;
    }
    return PyLong_FromSsize_t(cleared);
}

/* Add the batch's counts into the caller's counter list (ApplyStats' field order). */
static int
add_counts(PyObject *counts_list, const Py_ssize_t *counts)
{
    if (!PyList_Check(counts_list) || PyList_GET_SIZE(counts_list) != NUM_COUNTS) {
        PyErr_SetString(PyExc_TypeError, "counts must be a list of 9 ints");
        return -1;
    }
    for (int i = 0; i < NUM_COUNTS; i++) {
        if (!counts[i]) {
            continue;
        }
        Py_ssize_t before = PyLong_AsSsize_t(PyList_GET_ITEM(counts_list, i));
        if (before == -1 && PyErr_Occurred()) {
            return -1;
        }
        PyObject *after = PyLong_FromSsize_t(before + counts[i]);
        if (after == NULL) {
            return -1;
        }
        PyList_SetItem(counts_list, i, after);
    }
    return 0;
}

/* 1 if the key is held by any of the `num_entries` entry ids at `entries`, 0 if not. */
static int
held_by_entries(ShardObject *self, uint64_t key, const uint32_t *entries, Py_ssize_t num_entries)
{
    uint32_t n = find_node(self, key);
    if (n == NIL) {
        return 0;
    }
    uintptr_t holder = self->nodes[n].holder;
    uint32_t len = IS_SINGLE(holder) ? 1 : MULTI(holder)->len;
    for (uint32_t i = 0; i < len; i++) {
        uint32_t entry = IS_SINGLE(holder) ? SINGLE_ENTRY(holder) : MULTI(holder)->items[i].entry;
        for (Py_ssize_t e = 0; e < num_entries; e++) {
            if (entries[e] == entry) {
                return 1;
            }
        }
    }
    return 0;
}

/* An iterable of entry ids (a pod's: a frozenset of ints) into a new C array (PyMem_Free it); -1 with an
 * exception. */
static int
read_entries(ShardObject *self, PyObject *entry_ids, uint32_t **entries, Py_ssize_t *num_entries)
{
    PyObject *fast = PySequence_Fast(entry_ids, "a pod's entry ids must be iterable");
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t size = PySequence_Fast_GET_SIZE(fast);
    *entries = PyMem_Malloc(size ? (size_t)size * sizeof(uint32_t) : 1);
    *num_entries = 0;
    if (*entries == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        if (as_entry(self, PySequence_Fast_GET_ITEM(fast, i), &(*entries)[i]) < 0) {
            Py_DECREF(fast);
            return -1;
        }
        (*num_entries)++;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *
Shard_apply_steps(ShardObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t counts[NUM_COUNTS] = {0};
    PyObject *fast;
    int status = 0;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "apply_steps(steps, pod_entry_ids, counts)");
        return NULL;
    }
    PyObject *pod_entry_ids = args[1];
    uint32_t *entries = NULL; /* pod_entry_ids in C, read at the first parent check */
    Py_ssize_t num_entries = 0;
    fast = PySequence_Fast(args[0], "steps must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    for (Py_ssize_t s = 0; s < PySequence_Fast_GET_SIZE(fast) && status == 0; s++) {
        PyObject *step = PySequence_Fast_GET_ITEM(fast, s);
        Py_ssize_t size = PyTuple_Check(step) ? PyTuple_GET_SIZE(step) : 0;
        long kind = size ? PyLong_AsLong(PyTuple_GET_ITEM(step, 0)) : -1;
        uint32_t entry;
        if (kind == -1 && PyErr_Occurred()) {
            status = -1;
        }
        else if ((kind == STEP_STORE || kind == STEP_REMOVE) && size == 3) {
            status = as_entry(self, PyTuple_GET_ITEM(step, 1), &entry);
            if (status == 0) {
                status = kind == STEP_STORE ? store_step(self, entry, PyTuple_GET_ITEM(step, 2), counts)
                                            : remove_step(self, entry, PyTuple_GET_ITEM(step, 2), counts);
            }
        }
        else if (kind == STEP_CHECK_PARENT && size == 2) {
            uint64_t key = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(step, 1));
            if (key == (uint64_t)-1 && PyErr_Occurred()) {
                status = -1;
            }
            else if (entries == NULL && read_entries(self, pod_entry_ids, &entries, &num_entries) < 0) {
                status = -1;
            }
            else if (!held_by_entries(self, key, entries, num_entries)) {
                counts[C_UNKNOWN_PARENT]++;
            }
        }
        else if (kind == STEP_CLEAR && size == 1) {
            Py_ssize_t cleared = clear_entries(self, pod_entry_ids);
            if (cleared < 0) {
                status = -1;
            }
            else {
                counts[C_CLEARED] += cleared;
            }
        }
        else {
            PyErr_SetString(PyExc_TypeError, "not a shard step");
            status = -1;
        }
    }
    Py_DECREF(fast);
    PyMem_Free(entries);
    if (settle(self) < 0) {
        status = -1;
    }
    /* Counted even when a step failed part-way (it can only be memory exhaustion): the index changed. */
    if (add_counts(args[2], counts) < 0 || status < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- apply_events: one batch straight from kvindex's event objects ----------------------------------
 *
 * The facade's usual path turns a batch into steps in Python (indexer/index.py, KVIndex._validate: one
 * store step per chain of BlocksStored, key arrays checked by array('Q')), then apply_steps reads them.
 * apply_events reads the events themselves, with the same merging, into a list of operations over one
 * buffer of keys, and applies them only once the whole batch has been read. Whatever the facade must look
 * at itself (a tier this pod has no entry id for yet, a key that is not a plain int in range, an object
 * that is not one of the three events, key lists that are not tuples) declines the batch untouched
 * (False), and the facade takes its usual path, which interns, validates and says what is wrong. */

enum { OP_STORE, OP_REMOVE, OP_CHECK_PARENT, OP_CLEAR };

typedef struct {
    uint8_t kind;
    uint32_t entry;
    size_t first, count; /* keys in the batch's buffer */
    uint64_t parent;
} Op;

typedef struct {
    uint64_t *keys;
    size_t num_keys, cap_keys;
    Op *ops;
    size_t num_ops, cap_ops;
} Batch;

static PyObject *S_BLOCK_KEYS, *S_PARENT_KEY, *S_TIER;

enum { READ_OK = 0, READ_DECLINED = 1, READ_ERROR = -1 };

/* A plain int from 0 to 2**64 - 1 (bools and subclasses decline: the facade's path decides). */
static int
read_u64(PyObject *value, uint64_t *out)
{
    if (!PyLong_CheckExact(value)) {
        return READ_DECLINED;
    }
    return exact_u64(value, out) ? READ_OK : READ_DECLINED;
}

static int
batch_keys(Batch *batch, PyObject *keys, size_t *count)
{
    if (!PyTuple_CheckExact(keys)) {
        return READ_DECLINED;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (batch->num_keys + (size_t)n > batch->cap_keys) {
        size_t cap = batch->cap_keys ? batch->cap_keys : 256;
        while (cap < batch->num_keys + (size_t)n) {
            cap *= 2;
        }
        uint64_t *grown = realloc(batch->keys, cap * sizeof(uint64_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return READ_ERROR;
        }
        batch->keys = grown;
        batch->cap_keys = cap;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int status = read_u64(PyTuple_GET_ITEM(keys, i), &batch->keys[batch->num_keys + (size_t)i]);
        if (status != READ_OK) {
            return status;
        }
    }
    batch->num_keys += (size_t)n;
    *count = (size_t)n;
    return READ_OK;
}

static Op *
batch_op(Batch *batch)
{
    if (batch->num_ops == batch->cap_ops) {
        size_t cap = batch->cap_ops ? 2 * batch->cap_ops : 16;
        Op *grown = realloc(batch->ops, cap * sizeof(Op));
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        batch->ops = grown;
        batch->cap_ops = cap;
    }
    Op *op = &batch->ops[batch->num_ops++];
    memset(op, 0, sizeof(*op));
    return op;
}

/* A store or removal of `count` keys from `first` in the batch's buffer. */
static int
keys_op(Batch *batch, uint8_t kind, uint32_t entry, size_t first, size_t count)
{
    Op *op = batch_op(batch);
    if (op == NULL) {
        return -1;
    }
    op->kind = kind;
    op->entry = entry;
    op->first = first;
    op->count = count;
    return 0;
}

/* The entry id of an event's tier for this pod, from the facade's table (absent: declined). */
static int
tier_entry(ShardObject *self, PyObject *event, PyObject *tier_entry_ids, uint32_t *entry)
{
    PyObject *tier = PyObject_GetAttr(event, S_TIER);
    if (tier == NULL) {
        return READ_ERROR;
    }
    PyObject *entry_id = PyUnicode_CheckExact(tier) ? PyDict_GetItemWithError(tier_entry_ids, tier) : NULL;
    Py_DECREF(tier);
    if (entry_id == NULL) {
        return PyErr_Occurred() ? READ_ERROR : READ_DECLINED;
    }
    uint64_t value;
    int status = read_u64(entry_id, &value);
    if (status != READ_OK) {
        return status;
    }
    if (entries_reserve(self, value) < 0) {
        return READ_ERROR;
    }
    *entry = (uint32_t)value;
    return READ_OK;
}

/* A store's or removal's entry id (from its tier) and its keys, appended to the batch's buffer. */
static int
entry_and_keys(ShardObject *self, PyObject *event, PyObject *tier_entry_ids, Batch *batch, uint32_t *entry,
               size_t *count)
{
    int status = tier_entry(self, event, tier_entry_ids, entry);
    if (status != READ_OK) {
        return status;
    }
    PyObject *keys = PyObject_GetAttr(event, S_BLOCK_KEYS);
    if (keys == NULL) {
        return READ_ERROR;
    }
    status = batch_keys(batch, keys, count);
    Py_DECREF(keys);
    return status;
}

/* Mirrors KVIndex._validate: the same steps, as operations over one key buffer. */
static int
read_batch(ShardObject *self, PyObject *events, PyObject *tier_entry_ids, PyObject *const *kinds, Batch *batch)
{
    int last_is_store = 0;
    uint32_t last_entry = 0;
    uint64_t last_key = 0;
    size_t last_op = 0;
    Py_ssize_t num_events = PySequence_Fast_GET_SIZE(events);
    for (Py_ssize_t e = 0; e < num_events; e++) {
        PyObject *event = PySequence_Fast_GET_ITEM(events, e);
        PyTypeObject *type = Py_TYPE(event);
        int status;
        uint32_t entry;
        size_t first = batch->num_keys, count = 0;
        if ((PyObject *)type == kinds[0]) { /* BlocksStored */
            if ((status = entry_and_keys(self, event, tier_entry_ids, batch, &entry, &count)) != READ_OK) {
                return status;
            }
            PyObject *parent = PyObject_GetAttr(event, S_PARENT_KEY);
            if (parent == NULL) {
                return READ_ERROR;
            }
            if (parent != Py_None) {
                uint64_t parent_key;
                status = read_u64(parent, &parent_key);
                Py_DECREF(parent);
                if (status != READ_OK) {
                    return status;
                }
                if (last_is_store && parent_key == last_key && entry == last_entry) {
                    /* the chain goes on: its keys follow the previous store's in the buffer */
                    if (count) {
                        batch->ops[last_op].count += count;
                        last_key = batch->keys[first + count - 1];
                    }
                    continue;
                }
                Op *check = batch_op(batch);
                if (check == NULL) {
                    return READ_ERROR;
                }
                check->kind = OP_CHECK_PARENT;
                check->parent = parent_key;
            }
            else {
                Py_DECREF(parent);
            }
            if (count) {
                if (keys_op(batch, OP_STORE, entry, first, count) < 0) {
                    return READ_ERROR;
                }
                last_is_store = 1;
                last_op = batch->num_ops - 1;
                last_entry = entry;
                last_key = batch->keys[first + count - 1];
            }
            else {
                last_is_store = 0;
            }
            continue;
        }
        last_is_store = 0;
        if ((PyObject *)type == kinds[1]) { /* BlocksRemoved */
            if ((status = entry_and_keys(self, event, tier_entry_ids, batch, &entry, &count)) != READ_OK) {
                return status;
            }
            if (count && keys_op(batch, OP_REMOVE, entry, first, count) < 0) {
                return READ_ERROR;
            }
        }
        else if ((PyObject *)type == kinds[2]) { /* AllBlocksCleared */
            Op *clear = batch_op(batch);
            if (clear == NULL) {
                return READ_ERROR;
            }
            clear->kind = OP_CLEAR;
        }
        else {
            return READ_DECLINED;
        }
    }
    return READ_OK;
}

static PyObject *Shard_apply_many(ShardObject *self, PyObject *const *args, Py_ssize_t nargs);

/* apply_many of this one batch. */
static PyObject *
Shard_apply_events(ShardObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7 || !(PyTuple_CheckExact(args[0]) || PyList_CheckExact(args[0])) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "apply_events(events: tuple | list, tier_entry_ids: dict, pod_entry_ids, counts, "
                        "stored_type, removed_type, cleared_type)");
        return NULL;
    }
    PyObject *batch = PyTuple_Pack(4, args[0], args[1], args[2], args[3]);
    PyObject *batches = batch == NULL ? NULL : PyList_New(1);
    if (batches == NULL) {
        Py_XDECREF(batch);
        return NULL;
    }
    PyList_SET_ITEM(batches, 0, batch);
    PyObject *many_args[4] = {batches, args[4], args[5], args[6]};
    PyObject *applied = Shard_apply_many(self, many_args, 4);
    Py_DECREF(batches);
    if (applied == NULL) {
        return NULL;
    }
    int whole = PyLong_AsSsize_t(applied) == 1;
    Py_DECREF(applied);
    return PyBool_FromLong(whole);
}

/* ---- apply_many: several pods' batches, the table work of all of them without the GIL ---------------
 *
 * A worker's drain holds one batch per pod it heard from (with 1,000 pods, 64 pods of ~125 blocks each).
 * apply_events per batch keeps the GIL throughout (dropping it per batch hands it to the subscriber
 * thread, which the worker then waits to get back: see RELEASE_GIL_KEYS); here every batch is read with
 * the GIL, each pod's entry ids copied into C, and then the table work of the whole drain runs in one
 * stretch without the GIL, so the subscriber's Python work goes on on the other core meanwhile. The
 * batches are applied in order, exactly as apply_events would apply them one after the other. */

typedef struct {
    Batch batch;
    uint32_t *entries; /* the pod's entry ids (all tiers): parent checks and clears */
    Py_ssize_t num_entries;
    Py_ssize_t counts[NUM_COUNTS];
} PodBatch;

/* One batch's operations with the pod's entry ids in C: touches no Python object, so it may run without the
 * GIL. */
static int
apply_pod_batch(ShardObject *self, PodBatch *pod)
{
    const Batch *batch = &pod->batch;
    for (size_t i = 0; i < batch->num_ops; i++) {
        const Op *op = &batch->ops[i];
        if (op->kind == OP_STORE) {
            Log *log = &self->logs[op->entry];
            uint32_t start = log->len;
            if (log_extend(self, log, batch->keys + op->first, (Py_ssize_t)op->count) < 0) {
                log->len = start;
                return -1;
            }
            if (store_logged(self, op->entry, start, pod->counts, 0) < 0) {
                return -1;
            }
        }
        else if (op->kind == OP_REMOVE) {
            remove_keys(self, op->entry, batch->keys + op->first, (Py_ssize_t)op->count, pod->counts);
        }
        else if (op->kind == OP_CHECK_PARENT) {
            if (!held_by_entries(self, op->parent, pod->entries, pod->num_entries)) {
                pod->counts[C_UNKNOWN_PARENT]++;
            }
        }
        else {
            for (Py_ssize_t e = 0; e < pod->num_entries; e++) {
                pod->counts[C_CLEARED] += clear_entry(self, pod->entries[e]);
            }
        }
    }
    return 0;
}

static PyObject *
Shard_apply_many(ShardObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "apply_many(batches: list[(events, tier_entry_ids, pod_entry_ids, counts)], "
                        "stored_type, removed_type, cleared_type)");
        return NULL;
    }
    PyObject *batches = args[0];
    Py_ssize_t n = PyList_GET_SIZE(batches);
    PodBatch *pods = PyMem_Calloc(n ? (size_t)n : 1, sizeof(PodBatch));
    if (pods == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t num_read = 0, status = 0;
    size_t total_keys = 0;
    /* Read while the batches come in the compiled reader's shape; the first one it declines stops the
     * drain there (the facade applies that one its own way and calls again with the rest). */
    for (; num_read < n; num_read++) {
        PyObject *item = PyList_GET_ITEM(batches, num_read);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 4) {
            PyErr_SetString(PyExc_TypeError, "a batch must be (events, tier_entry_ids, pod_entry_ids, counts)");
            status = -1;
            break;
        }
        PyObject *events = PyTuple_GET_ITEM(item, 0), *tier_entry_ids = PyTuple_GET_ITEM(item, 1);
        PyObject *entry_ids = PyTuple_GET_ITEM(item, 2);
        if (!(PyTuple_CheckExact(events) || PyList_CheckExact(events)) || !PyDict_Check(tier_entry_ids) ||
            !PyFrozenSet_CheckExact(entry_ids)) {
            break;
        }
        int read = read_batch(self, events, tier_entry_ids, args + 1, &pods[num_read].batch);
        if (read == READ_OK) {
            read = read_entries(self, entry_ids, &pods[num_read].entries, &pods[num_read].num_entries) < 0
                       ? READ_ERROR
                       : READ_OK;
        }
        if (read != READ_OK) {
            free(pods[num_read].batch.keys);
            free(pods[num_read].batch.ops);
            PyMem_Free(pods[num_read].entries);
            memset(&pods[num_read], 0, sizeof(PodBatch));
            status = read == READ_ERROR ? -1 : 0;
            break;
        }
        total_keys += pods[num_read].batch.num_keys;
    }
    Py_ssize_t num_applied = 0;
    if (status == 0) {
        int failed = 0;
        if (total_keys >= RELEASE_GIL_KEYS) {
            Py_BEGIN_ALLOW_THREADS
            for (; num_applied < num_read && !failed; num_applied++) {
                failed = apply_pod_batch(self, &pods[num_applied]) < 0;
            }
            Py_END_ALLOW_THREADS
        }
        else {
            for (; num_applied < num_read && !failed; num_applied++) {
                failed = apply_pod_batch(self, &pods[num_applied]) < 0;
            }
        }
        if (settle(self) < 0 || failed) {
            status = -1;
        }
        /* Counted even when a batch failed part-way (memory exhaustion only): the index changed. */
        for (Py_ssize_t i = 0; i < num_applied; i++) {
            if (add_counts(PyTuple_GET_ITEM(PyList_GET_ITEM(batches, i), 3), pods[i].counts) < 0) {
                status = -1;
            }
        }
    }
    for (Py_ssize_t i = 0; i < num_read; i++) {
        free(pods[i].batch.keys);
        free(pods[i].batch.ops);
        PyMem_Free(pods[i].entries);
    }
    PyMem_Free(pods);
    if (status < 0) {
        return NULL;
    }
    return PyLong_FromSsize_t(num_applied);
}

/* ---- the read path ---- */

/* The id object of `entry` (new reference): the one inside the index's single-holder answer `(entry,)`
 * when there is one, so every tuple of every shard holds the same object for an entry and an answer's
 * reader compares holders by identity, not by value. */
static PyObject *
canonical_entry(uint32_t entry, PyObject *single_ids)
{
    if ((Py_ssize_t)entry < PyList_GET_SIZE(single_ids)) {
        PyObject *single = PyList_GET_ITEM(single_ids, entry);
        if (PyTuple_CheckExact(single) && PyTuple_GET_SIZE(single) == 1) {
            return Py_NewRef(PyTuple_GET_ITEM(single, 0));
        }
    }
    return entry_object(entry);
}

/* Whether `ids` (a tuple of entry id ints) holds exactly the multi holder's entries, in order. */
static int
ids_match(PyObject *ids, const Multi *multi)
{
    if (PyTuple_GET_SIZE(ids) != (Py_ssize_t)multi->len) {
        return 0;
    }
    for (uint32_t i = 0; i < multi->len; i++) {
        if (PyLong_AsUnsignedLong(PyTuple_GET_ITEM(ids, i)) != multi->items[i].entry) {
            return 0;
        }
    }
    return 1;
}

/* The lookup answer for a multi holder: its cached tuple, else `last` or one of the shard's recently made
 * tuples if it has the same ids in the same order, else a new one. Borrowed. Equal answers are one tuple,
 * as shard.py's interning makes them, whatever order the keys were first read in (a prompt hashed while
 * its blocks are looked up reads its prefix one key per lookup): the blocks of a shared prefix share one
 * tuple, and the answer writer sees runs by identity instead of comparing ~100 ids a block. */
static PyObject *
multi_ids(ShardObject *self, Multi *multi, PyObject *last, PyObject *single_ids)
{
    if (multi->ids != NULL) {
        return multi->ids;
    }
    if (last != NULL && ids_match(last, multi)) {
        multi->ids = Py_NewRef(last);
        return last;
    }
    uint64_t mix = multi->len;
    for (uint32_t i = 0; i < multi->len; i++) {
        mix = (mix ^ multi->items[i].entry) * 0x9E3779B97F4A7C15ULL;
    }
    PyObject **recent = &self->recent_ids[(mix >> 32) & (RECENT_IDS - 1)];
    if (*recent != NULL && ids_match(*recent, multi)) {
        multi->ids = Py_NewRef(*recent);
        return *recent;
    }
    PyObject *ids = PyTuple_New(multi->len);
    if (ids == NULL) {
        return NULL;
    }
    for (uint32_t i = 0; i < multi->len; i++) {
        PyObject *id = canonical_entry(multi->items[i].entry, single_ids);
        if (id == NULL) {
            Py_DECREF(ids);
            return NULL;
        }
        PyTuple_SET_ITEM(ids, i, id);
    }
    multi->ids = ids;
    Py_XSETREF(*recent, Py_NewRef(ids));
    return ids;
}

/* A key of a lookup as a 64-bit key: 1, or 0 for an object this index cannot hold (a dict lookup in
 * shard.py just misses it), or -1 on another error. */
static int
as_lookup_key(PyObject *key_object, uint64_t *key)
{
    if (PyLong_CheckExact(key_object)) {
        return exact_u64(key_object, key);
    }
    *key = PyLong_AsUnsignedLongLong(key_object);
    if (*key == (uint64_t)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* The ids holding node `n` (NIL: nobody holds its key) (borrowed), NULL with no error set when nobody
 * does, NULL with an error on failure. *last is the previous multi holder's answer, updated when this one
 * is a multi holder too. */
static PyObject *
ids_of_node(ShardObject *self, uint32_t n, PyObject *single_ids, PyObject **last)
{
    if (n == NIL) {
        return NULL;
    }
    uintptr_t holder = self->nodes[n].holder;
    if (IS_SINGLE(holder)) {
        uint32_t entry = SINGLE_ENTRY(holder);
        if ((Py_ssize_t)entry >= PyList_GET_SIZE(single_ids)) {
            PyErr_SetString(PyExc_IndexError, "entry id without a single-id tuple");
            return NULL;
        }
        return PyList_GET_ITEM(single_ids, entry);
    }
    PyObject *ids = multi_ids(self, MULTI(holder), *last, single_ids);
    if (ids != NULL) {
        *last = ids;
    }
    return ids;
}

/* ids_of_node of the node holding `key`. */
static PyObject *
ids_of(ShardObject *self, uint64_t key, PyObject *single_ids, PyObject **last)
{
    return ids_of_node(self, find_node(self, key), single_ids, last);
}

/* Keys are read LOOKUP_CHUNK at a time and resolved in order once their three dependent misses (slot,
 * node, and a multi holder's record) have each been asked for, chunk-wide, one stage after another. */
#define LOOKUP_CHUNK 32

/* The node of `key` (found: its slot and node have been asked for), with a multi holder's record asked for
 * too. */
static inline uint32_t
find_prefetching_holder(ShardObject *self, uint64_t key)
{
    uint32_t n = find_node(self, key);
    if (n != NIL && !IS_SINGLE(self->nodes[n].holder)) {
        __builtin_prefetch(MULTI(self->nodes[n].holder));
    }
    return n;
}

/* The lookup's keys: a packed array('Q') (read in place, no int object per key) or a sequence of ints. */
typedef struct {
    PyObject *fast;        /* the sequence's items, or NULL for a packed array */
    const uint64_t *packed; /* the array's keys */
    Py_ssize_t size;
} lookup_keys;

/* Key i of `source` to *key: 1 if it can be a key, 0 if it cannot (no pod holds it), -1 on error. */
static int
lookup_key_at(const lookup_keys *source, Py_ssize_t i, uint64_t *key)
{
    if (source->fast == NULL) {
        memcpy(key, source->packed + i, sizeof *key);
        return 1;
    }
    return as_lookup_key(PySequence_Fast_GET_ITEM(source->fast, i), key);
}

/* A native unsigned 64-bit buffer (array('Q'), or 'L' where long is 8 bytes): 1 and *view held; 0 for
 * anything else (read as a sequence), with no error set; -1 on error. */
static int
packed_keys(PyObject *keys, Py_buffer *view)
{
    if (PyList_Check(keys) || PyTuple_Check(keys) || !PyObject_CheckBuffer(keys)) {
        return 0;
    }
    if (PyObject_GetBuffer(keys, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->itemsize == 8 && view->format != NULL
        && (strcmp(view->format, "Q") == 0 || strcmp(view->format, "L") == 0)) {
        return 1;
    }
    PyBuffer_Release(view);
    return 0;
}

/* The node of `key` if it is the one after node `prev` (NIL: none), else NIL. A prompt's blocks are
 * stored in order, a prefill's by one event, so their nodes are mostly consecutive (those of a 512-block
 * prompt in the score benchmark's index: one in ~128 is not): such a key is found in the node array next
 * to the previous one, without its slot, a random read of the key table (and a TLB miss: it is tens of
 * MB). A node is in the table exactly while its holder is set (see key_erase). */
static inline uint32_t
chained_node(const ShardObject *self, uint32_t prev, uint64_t key)
{
    if (prev == NIL || prev + 1 >= self->nodes_len) {
        return NIL;
    }
    const Node *next = &self->nodes[prev + 1];
    return next->holder != 0 && next->key == key ? prev + 1 : NIL;
}

/* How far along a chain of nodes the lookup asks for holder records ahead of need: a key costs ~10 ns
 * warm, a cold record a few hundred. */
#define CHAIN_AHEAD 32

/* Ask for the multi holder record of node n, if it has one: each is its own allocation, the lookup's
 * one certain miss per key held by several pods. */
static inline void
prefetch_multi(const ShardObject *self, uint32_t n)
{
    if (n < self->nodes_len) {
        uintptr_t holder = self->nodes[n].holder;
        if (holder != 0 && !IS_SINGLE(holder)) {
            __builtin_prefetch(MULTI(holder));
        }
    }
}

/* lookup_run's result for found node n: its ids appended to `out`. 0 done, -1 error. */
static int
append_ids(ShardObject *self, uint32_t n, PyObject *single_ids, PyObject **last, PyObject *out)
{
    PyObject *ids = ids_of_node(self, n, single_ids, last);
    return ids == NULL ? -1 : PyList_Append(out, ids);
}

static PyObject *
Shard_lookup_run(ShardObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[1]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "lookup_run(block_keys, single_ids: list, out: list)");
        return NULL;
    }
    Py_buffer view;
    lookup_keys source = {NULL, NULL, 0};
    int is_packed = packed_keys(args[0], &view);
    if (is_packed) {
        source.packed = (const uint64_t *)view.buf;
        source.size = view.len / 8;
    } else {
        source.fast = PySequence_Fast(args[0], "block keys must be a sequence");
        if (source.fast == NULL) {
            return NULL;
        }
        source.size = PySequence_Fast_GET_SIZE(source.fast);
    }
    PyObject *last = NULL;
    uint64_t keys[LOOKUP_CHUNK];
    uint32_t nodes[LOOKUP_CHUNK];
    int failed = 0;
    int stopped = 0;       /* a key nobody holds was reached */
    uint32_t prev = NIL;   /* the previous key's node */
    int by_table = 0;      /* the previous key was found through the key table, not along the chain */
    Py_ssize_t base = 0;
    while (base < source.size && !failed && !stopped) {
        uint64_t key;
        int readable = lookup_key_at(&source, base, &key);
        if (readable <= 0) {
            failed = readable < 0;
            break; /* else the lookup stops here: nobody holds it */
        }
        uint32_t n = chained_node(self, prev, key);
        if (n != NIL) {
            /* The chain likely goes on: ask for the holder records of the nodes after it ahead of need
             * (its own and the next CHAIN_AHEAD where the chain starts, then one more per key). */
            for (uint32_t ahead = by_table ? 0 : CHAIN_AHEAD; ahead <= CHAIN_AHEAD; ahead++) {
                prefetch_multi(self, n + ahead);
            }
            failed = append_ids(self, n, args[1], &last, args[2]) < 0;
            prev = n;
            by_table = 0;
            base++;
            continue;
        }
        /* Through the key table: this key alone where a chain just broke (the next one likely follows
         * it), else LOOKUP_CHUNK keys, their misses overlapped stage by stage. */
        Py_ssize_t chunk = by_table ? LOOKUP_CHUNK : 1;
        if (chunk > source.size - base) {
            chunk = source.size - base;
        }
        Py_ssize_t valid = 0;
        while (valid < chunk) {
            readable = lookup_key_at(&source, base + valid, &keys[valid]);
            if (readable < 0) {
                failed = 1;
                break;
            }
            if (!readable) {
                break; /* the lookup stops here: nobody holds it */
            }
            prefetch_slot(self, keys[valid]);
            valid++;
        }
        if (failed) {
            break;
        }
        for (Py_ssize_t j = 0; j < valid; j++) {
            prefetch_node(self, keys[j]);
        }
        for (Py_ssize_t j = 0; j < valid; j++) {
            nodes[j] = find_prefetching_holder(self, keys[j]);
        }
        Py_ssize_t j = 0;
        for (; j < valid && nodes[j] != NIL; j++) {
            if (append_ids(self, nodes[j], args[1], &last, args[2]) < 0) {
                failed = 1;
                break;
            }
        }
        if (failed) {
            break;
        }
        if (j < chunk) {
            stopped = 1; /* a key nobody holds (or none the index can hold) */
            break;
        }
        prev = nodes[valid - 1];
        by_table = 1;
        base += valid;
    }
    if (is_packed) {
        PyBuffer_Release(&view);
    } else {
        Py_DECREF(source.fast);
    }
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Shard_ids_of(ShardObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "ids_of(block_key, single_ids: list)");
        return NULL;
    }
    PyObject *last = NULL;
    uint64_t key;
    int readable = as_lookup_key(args[0], &key);
    if (readable <= 0) {
        if (readable < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    PyObject *ids = ids_of(self, key, args[1], &last);
    if (ids == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    Py_INCREF(ids);
    return ids;
}

/* ---- counts and views ---- */

static PyObject *
Shard_num_keys(ShardObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLong(self->count);
}

static PyObject *
Shard_live_of(ShardObject *self, PyObject *entry_object)
{
    unsigned long entry = PyLong_AsUnsignedLong(entry_object);
    if (entry == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromLongLong(entry < self->entries_cap ? self->live[entry] : 0);
}

static PyObject *
Shard_live_total(ShardObject *self, PyObject *Py_UNUSED(ignored))
{
    long long total = 0;
    for (uint32_t e = 0; e < self->entries_cap; e++) {
        total += self->live[e];
    }
    return PyLong_FromLongLong(total);
}

static PyObject *
holder_copies(uintptr_t holder)
{
    PyObject *copies = PyDict_New();
    uint32_t len = IS_SINGLE(holder) ? 1 : MULTI(holder)->len;
    if (copies == NULL) {
        return NULL;
    }
    for (uint32_t i = 0; i < len; i++) {
        uint32_t entry = IS_SINGLE(holder) ? SINGLE_ENTRY(holder) : MULTI(holder)->items[i].entry;
        uint32_t count = IS_SINGLE(holder) ? 1 : MULTI(holder)->items[i].copies;
        PyObject *id = entry_object(entry);
        PyObject *value = PyLong_FromUnsignedLong(count);
        int status = (id && value) ? PyDict_SetItem(copies, id, value) : -1;
        Py_XDECREF(id);
        Py_XDECREF(value);
        if (status < 0) {
            Py_DECREF(copies);
            return NULL;
        }
    }
    return copies;
}

static PyObject *
Shard_copies_by_key(ShardObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *result = PyList_New(0);
    if (result == NULL) {
        return NULL;
    }
    for (uint32_t n = self->head; n != NIL; n = self->nodes[n].next) {
        PyObject *copies = holder_copies(self->nodes[n].holder);
        PyObject *pair = copies ? Py_BuildValue("(KN)", (unsigned long long)self->nodes[n].key, copies) : NULL;
        if (pair == NULL || PyList_Append(result, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return result;
}

static int
problem(PyObject *problems, PyObject *message)
{
    int status = message ? PyList_Append(problems, message) : -1;
    Py_XDECREF(message);
    return status;
}

static int
logged(const ShardObject *self, uint32_t entry, uint64_t key, uint64_t **sorted)
{
    const Log *log = &self->logs[entry];
    if (log->keys == NULL) {
        return 0;
    }
    if (sorted[entry] == NULL) {
        sorted[entry] = malloc((size_t)(log->len ? log->len : 1) * sizeof(uint64_t));
        if (sorted[entry] == NULL) {
            return -1;
        }
        memcpy(sorted[entry], log->keys, (size_t)log->len * sizeof(uint64_t));
        qsort(sorted[entry], log->len, sizeof(uint64_t), compare_keys);
    }
    return bsearch(&key, sorted[entry], log->len, sizeof(uint64_t), compare_keys) != NULL;
}

/* Violations of this shard's invariants (shard.py's problems, plus the table's own). */
static int
collect_problems(ShardObject *self, long shard_no, unsigned long long num_shards, PyObject *problems,
                 int64_t *held, uint64_t **sorted)
{
    uint32_t walked = 0;
    if ((Py_ssize_t)self->count > self->capacity
        && problem(problems, PyUnicode_FromFormat("shard %ld: %u keys > %zd", shard_no, self->count,
                                                  self->capacity)) < 0) {
        return -1;
    }
    for (uint32_t n = self->head; n != NIL; n = self->nodes[n].next) {
        const Node *node = &self->nodes[n];
        unsigned long long key = node->key;
        uintptr_t holder = node->holder;
        uint32_t len = IS_SINGLE(holder) ? 1 : MULTI(holder)->len;
        if (++walked > self->count) {
            return problem(problems, PyUnicode_FromFormat("shard %ld: the key LRU has a cycle", shard_no));
        }
        if (num_shards && key % num_shards != (unsigned long long)shard_no
            && problem(problems, PyUnicode_FromFormat("key %llu in shard %ld", key, shard_no)) < 0) {
            return -1;
        }
        if (find_node(self, node->key) != n
            && problem(problems, PyUnicode_FromFormat("shard %ld: key %llu not in the key table", shard_no,
                                                      key)) < 0) {
            return -1;
        }
        if (!IS_SINGLE(holder)) {
            Multi *multi = MULTI(holder);
            if ((multi->len < 1 || (Py_ssize_t)multi->len > self->max_pods_per_key)
                && problem(problems, PyUnicode_FromFormat("key %llu: %u holders in a dict", key,
                                                          multi->len)) < 0) {
                return -1;
            }
            if (multi->len == 1 && multi->items[0].copies == 1
                && problem(problems, PyUnicode_FromFormat("key %llu: one holder with one copy left in a dict",
                                                          key)) < 0) {
                return -1;
            }
            for (uint32_t i = 0; i < multi->len; i++) {
                if ((multi->items[i].copies < 1 || multi->items[i].copies > MAX_COPIES)
                    && problem(problems, PyUnicode_FromFormat("key %llu: copy counts out of range", key)) < 0) {
                    return -1;
                }
            }
            if (multi->ids != NULL) {
                int stale = PyTuple_GET_SIZE(multi->ids) != (Py_ssize_t)multi->len;
                for (uint32_t i = 0; !stale && i < multi->len; i++) {
                    stale = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(multi->ids, i)) != multi->items[i].entry;
                }
                if (stale
                    && problem(problems, PyUnicode_FromFormat("shard %ld: stale lookup tuple for key %llu",
                                                              shard_no, key)) < 0) {
                    return -1;
                }
            }
        }
        for (uint32_t i = 0; i < len; i++) {
            uint32_t entry = IS_SINGLE(holder) ? SINGLE_ENTRY(holder) : MULTI(holder)->items[i].entry;
            int found;
            if (entry >= self->entries_cap) {
                if (problem(problems, PyUnicode_FromFormat("shard %ld: key %llu held by unknown entry %u",
                                                           shard_no, key, entry)) < 0) {
                    return -1;
                }
                continue;
            }
            held[entry]++;
            found = logged(self, entry, node->key, sorted);
            if (found < 0) {
                PyErr_NoMemory();
                return -1;
            }
            if (!found
                && problem(problems, PyUnicode_FromFormat("shard %ld: key %llu missing from entry %u's log",
                                                          shard_no, key, entry)) < 0) {
                return -1;
            }
        }
    }
    if (walked != self->count
        && problem(problems, PyUnicode_FromFormat("shard %ld: %u keys in the LRU, %u counted", shard_no, walked,
                                                  self->count)) < 0) {
        return -1;
    }
    for (uint32_t e = 0; e < self->entries_cap; e++) {
        if (self->live[e] != held[e]
            && problem(problems, PyUnicode_FromFormat("shard %ld: live count %lld of entry %u != %lld held pairs",
                                                      shard_no, (long long)self->live[e], e,
                                                      (long long)held[e])) < 0) {
            return -1;
        }
    }
    return 0;
}

static PyObject *
Shard_problems(ShardObject *self, PyObject *args)
{
    long shard_no;
    unsigned long long num_shards;
    if (!PyArg_ParseTuple(args, "lK", &shard_no, &num_shards)) {
        return NULL;
    }
    PyObject *problems = PyList_New(0);
    int64_t *held = calloc(self->entries_cap ? self->entries_cap : 1, sizeof(int64_t));
    uint64_t **sorted = calloc(self->entries_cap ? self->entries_cap : 1, sizeof(uint64_t *));
    int status = -1;
    if (problems == NULL || held == NULL || sorted == NULL) {
        if (problems != NULL) {
            PyErr_NoMemory();
        }
    }
    else {
        status = collect_problems(self, shard_no, num_shards, problems, held, sorted);
    }
    for (uint32_t e = 0; sorted != NULL && e < self->entries_cap; e++) {
        free(sorted[e]);
    }
    free(sorted);
    free(held);
    if (status < 0) {
        Py_XDECREF(problems);
        return NULL;
    }
    return problems;
}

/* ---- the type ---- */

static int
Shard_init(ShardObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"capacity", "max_pods_per_key", NULL};
    Py_ssize_t capacity, max_pods_per_key;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nn", names, &capacity, &max_pods_per_key)) {
        return -1;
    }
    if (capacity < 1 || max_pods_per_key < 1 || capacity >= (Py_ssize_t)(NIL / 2)) {
        PyErr_Format(PyExc_ValueError, "capacity must be in [1, %u) and max_pods_per_key >= 1, got %zd, %zd",
                     NIL / 2, capacity, max_pods_per_key);
        return -1;
    }
    if (self->slots != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a shard is initialised once");
        return -1;
    }
    self->capacity = capacity;
    self->low_water = capacity - capacity / 64;
    self->max_pods_per_key = max_pods_per_key;
    self->head = self->tail = self->free_head = NIL;
    table_resize(self, 6);
    return settle(self);
}

static void
Shard_dealloc(ShardObject *self)
{
    for (uint32_t n = self->head; self->nodes != NULL && n != NIL; n = self->nodes[n].next) {
        if (!IS_SINGLE(self->nodes[n].holder)) {
            multi_free(self, MULTI(self->nodes[n].holder));
        }
    }
    for (uint32_t e = 0; e < self->entries_cap; e++) {
        free(self->logs[e].keys);
    }
    for (size_t i = 0; i < RECENT_IDS; i++) {
        Py_CLEAR(self->recent_ids[i]);
    }
    self->failure = FAILED_NOTHING; /* settle only releases here: nothing may be raised from a dealloc */
    settle(self);
    free(self->garbage);
    free(self->logs);
    free(self->live);
    free(self->nodes);
    free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Shard_methods[] = {
    {"apply_steps", (PyCFunction)(void (*)(void))Shard_apply_steps, METH_FASTCALL,
     "apply_steps(steps, pod_entry_ids, counts): apply one batch's steps for this shard, in order."},
    {"apply_events", (PyCFunction)(void (*)(void))Shard_apply_events, METH_FASTCALL,
     "apply_events(events, tier_entry_ids, pod_entry_ids, counts, stored_type, removed_type, cleared_type) "
     "-> bool: apply one batch's events whole, or decline it untouched (False)."},
    {"apply_many", (PyCFunction)(void (*)(void))Shard_apply_many, METH_FASTCALL,
     "apply_many(batches, stored_type, removed_type, cleared_type) -> int: apply each (events, "
     "tier_entry_ids, pod_entry_ids, counts) in order, the table work without the GIL; stops at the first "
     "batch it declines and returns how many it applied."},
    {"clear_entries", (PyCFunction)Shard_clear_entries, METH_O,
     "clear_entries(entry_ids) -> int: drop every pair of these entries."},
    {"lookup_run", (PyCFunction)(void (*)(void))Shard_lookup_run, METH_FASTCALL,
     "lookup_run(block_keys, single_ids, out): append the ids holding each leading key; stop at a miss."},
    {"ids_of", (PyCFunction)(void (*)(void))Shard_ids_of, METH_FASTCALL,
     "ids_of(block_key, single_ids) -> tuple | None: the ids holding one key."},
    {"num_keys", (PyCFunction)Shard_num_keys, METH_NOARGS, "Keys held."},
    {"live_of", (PyCFunction)Shard_live_of, METH_O, "Pairs one entry holds here."},
    {"live_total", (PyCFunction)Shard_live_total, METH_NOARGS, "Pairs held here."},
    {"copies_by_key", (PyCFunction)Shard_copies_by_key, METH_NOARGS,
     "Every key with its holders' copy counts, least recently stored first."},
    {"problems", (PyCFunction)Shard_problems, METH_VARARGS,
     "problems(shard_no, num_shards) -> list[str]: violated invariants."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Shard_members[] = {
    {"capacity", T_PYSSIZET, offsetof(ShardObject, capacity), READONLY, NULL},
    {"low_water", T_PYSSIZET, offsetof(ShardObject, low_water), READONLY, NULL},
    {"max_pods_per_key", T_PYSSIZET, offsetof(ShardObject, max_pods_per_key), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ShardType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvindex.indexer._shard.Shard",
    .tp_basicsize = sizeof(ShardObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One index shard: the key LRU of block keys and each key's holders (see indexer/shard.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Shard_init,
    .tp_dealloc = (destructor)Shard_dealloc,
    .tp_methods = Shard_methods,
    .tp_members = Shard_members,
};

static struct PyModuleDef shard_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvindex.indexer._shard",
    .m_doc = "The compiled core of one index shard (indexer/shard.py is the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__shard(void)
{
    PyObject *module;
    if (PyType_Ready(&ShardType) < 0) {
        return NULL;
    }
    S_BLOCK_KEYS = PyUnicode_InternFromString("block_keys");
    S_PARENT_KEY = PyUnicode_InternFromString("parent_key");
    S_TIER = PyUnicode_InternFromString("tier");
    if (S_BLOCK_KEYS == NULL || S_PARENT_KEY == NULL || S_TIER == NULL) {
        return NULL;
    }
    module = PyModule_Create(&shard_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&ShardType);
    if (PyModule_AddObject(module, "Shard", (PyObject *)&ShardType) < 0) {
        Py_DECREF(&ShardType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
