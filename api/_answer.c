/* kvindex.api._answer: a score answer's `scores` array, ranked and written as JSON in one pass.
 *
 * At 1,000 pods a prompt's answer has ~200 entries, and building them in Python was most of a request's
 * server time: a PodScore and a by_tier dict per entry in the scorer, a copy of each with its pod's state
 * and age, then msgspec walking them again (~1.5 us an entry, ~300 us a request). Here the entries are
 * never objects: from the index's holder ids of each leading block, the first block's (pod, tier)
 * entries and their pods' healths (given, or read from the ingest streams themselves: a live stream's
 * state without a Python object per pod), this finds each entry's run, ranks, filters and orders them exactly
 * as indexer/scorer.py's score_prefix and api/answer.py's with_health do, and writes the bytes msgspec
 * would write for that list of PodScore.
 *
 * It covers the common shape only: each pod holds one entry (one tier) among the first block's holders.
 * It returns None for anything else -- a pod on several tiers, a string JSON must escape, a float msgspec
 * writes with an exponent, an argument of an unexpected type -- and the caller takes the Python path,
 * which stays the definition (tests/api/test_answer.py compares both byte for byte).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double score;
    Py_ssize_t run;
    long long dp_rank;
    PyObject *pod_id; /* new references, released in rows_free */
    PyObject *tier;
    const char *pod_utf8; /* their UTF-8, owned by the str objects: ranked bytewise (code point order) */
    const char *tier_utf8;
    Py_ssize_t pod_len;
    Py_ssize_t tier_len;
    PyObject *state;
    PyObject *age;   /* a float or None; NULL for a live row, whose age is `live_age` */
    double live_age; /* no float object per row: a compact answer never writes it */
    Py_ssize_t entry_id;
    Py_ssize_t seen; /* the last run (by number) whose holders include this entry */
    int group;       /* 0: vouched, 1: other, -1: left out */
} Row;

static PyObject *str_pod_id, *str_dp_rank, *str_state, *str_age, *str_disconnected, *str_live;
static PyObject *str_last_event_at, *str_connect_mode, *str_connected, *str_hash_mismatch, *str_owned;
static PyObject *str_tracker, *str_joined, *str_resyncing;

/* -- struct fields ----------------------------------------------------------------------------------
 * PodRef and PodHealth are msgspec Structs, whose fields are member descriptors over object slots. A
 * field's slot offset is looked up on first use and read directly from objects of that exact type (a
 * generic getattr was a fifth of this module's time); any other object takes getattr. The module keeps
 * one set (`answer_fields`, read and written with the GIL held) and a reference to each type it resolved,
 * so an offset never outlives its type. */

typedef struct {
    PyObject *name;
    PyTypeObject *type; /* NULL until resolved; then a reference, held for the module's life */
    Py_ssize_t offset;
} Field;

/* The field's value read from its slot (borrowed) if `obj` is of the field's resolved type and the slot is
 * set, else NULL (no exception). */
static inline PyObject *
field_slot(const Field *field, PyObject *obj)
{
    if (field->type == NULL || Py_TYPE(obj) != field->type) {
        return NULL;
    }
    return *(PyObject **)((char *)obj + field->offset);
}

/* A new reference to the field's value, NULL with an exception (AttributeError when unset). */
static PyObject *
field_get(Field *field, PyObject *obj)
{
    if (field->type == NULL) {
        PyObject *descr = _PyType_Lookup(Py_TYPE(obj), field->name); /* borrowed */
        if (descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            if (member->type == T_OBJECT_EX) {
                field->type = (PyTypeObject *)Py_NewRef(Py_TYPE(obj));
                field->offset = member->offset;
            }
        }
    }
    PyObject *value = field_slot(field, obj);
    return value != NULL ? Py_NewRef(value) : PyObject_GetAttr(obj, field->name);
}

typedef struct {
    Field pod_id, dp_rank, state, age, disconnected;
    Field last_event_at, connect_mode, connected, hash_mismatch, owned, tracker, joined, resyncing;
} Fields;

static void
fields_init(Fields *fields)
{
    Field *all[] = {&fields->pod_id, &fields->dp_rank, &fields->state, &fields->age, &fields->disconnected,
                    &fields->last_event_at, &fields->connect_mode, &fields->connected, &fields->hash_mismatch,
                    &fields->owned, &fields->tracker, &fields->joined, &fields->resyncing};
    PyObject *names[] = {str_pod_id, str_dp_rank, str_state, str_age, str_disconnected,
                         str_last_event_at, str_connect_mode, str_connected, str_hash_mismatch,
                         str_owned, str_tracker, str_joined, str_resyncing};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        all[i]->name = names[i];
        all[i]->type = NULL;
        all[i]->offset = 0;
    }
}

static Fields answer_fields;

/* -- entry id -> row: open addressing over a power-of-two table ------------------------------------ */

typedef struct {
    Py_ssize_t *keys;
    Py_ssize_t *rows;
    size_t mask;
} IdMap;

static int
idmap_init(IdMap *map, Py_ssize_t n)
{
    size_t size = 8;
    while (size < (size_t)n * 2) {
        size <<= 1;
    }
    map->keys = PyMem_Malloc(size * sizeof(Py_ssize_t));
    map->rows = PyMem_Malloc(size * sizeof(Py_ssize_t));
    if (map->keys == NULL || map->rows == NULL) {
        PyMem_Free(map->keys);
        PyMem_Free(map->rows);
        map->keys = map->rows = NULL;
        return -1;
    }
    for (size_t i = 0; i < size; i++) {
        map->keys[i] = -1;
    }
    map->mask = size - 1;
    return 0;
}

static void
idmap_free(IdMap *map)
{
    PyMem_Free(map->keys);
    PyMem_Free(map->rows);
}

static inline size_t
idmap_slot(const IdMap *map, Py_ssize_t key)
{
    size_t slot = ((size_t)key * 0x9E3779B97F4A7C15ULL) >> 17;
    slot &= map->mask;
    while (map->keys[slot] != -1 && map->keys[slot] != key) {
        slot = (slot + 1) & map->mask;
    }
    return slot;
}

/* 1 if added, 0 if the key was there already. */
static inline int
idmap_add(IdMap *map, Py_ssize_t key, Py_ssize_t row)
{
    size_t slot = idmap_slot(map, key);
    if (map->keys[slot] == key) {
        return 0;
    }
    map->keys[slot] = key;
    map->rows[slot] = row;
    return 1;
}

static inline Py_ssize_t
idmap_get(const IdMap *map, Py_ssize_t key)
{
    if (key < 0) {
        return -1;
    }
    size_t slot = idmap_slot(map, key);
    return map->keys[slot] == key ? map->rows[slot] : -1;
}

/* -- output buffer -------------------------------------------------------------------------------- */

typedef struct {
    char *data;
    size_t len;
    size_t cap;
} Buf;

static int
buf_reserve(Buf *buf, size_t more)
{
    if (buf->len + more <= buf->cap) {
        return 0;
    }
    size_t cap = buf->cap ? buf->cap : 1024;
    while (cap < buf->len + more) {
        cap *= 2;
    }
    char *data = PyMem_Realloc(buf->data, cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    buf->data = data;
    buf->cap = cap;
    return 0;
}

static inline void
buf_put(Buf *buf, const char *text, size_t len)
{
    memcpy(buf->data + buf->len, text, len);
    buf->len += len;
}

#define PUT_LITERAL(buf, text) buf_put((buf), (text), sizeof(text) - 1)

/* Digits of a non-negative value, written backwards from `end`; returns where they start. */
static inline char *
digits_before(char *end, unsigned long long value)
{
    do {
        *--end = (char)('0' + value % 10);
        value /= 10;
    } while (value);
    return end;
}

static void
put_int(Buf *buf, long long value)
{
    char text[24];
    char *end = text + sizeof text;
    unsigned long long magnitude = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    char *start = digits_before(end, magnitude);
    if (value < 0) {
        *--start = '-';
    }
    buf_put(buf, start, (size_t)(end - start));
}

/* The float as msgspec writes it (its shortest round-trip digits); -1 with no exception when msgspec's
 * form could differ from Python's repr (an exponent, a non-finite value), -1 with one on failure. */
static int
put_float(Buf *buf, double value)
{
    if (!isfinite(value)) {
        return -1;
    }
    /* Ages come rounded to the millisecond and most scores are whole: a value that is exactly the double
     * nearest k / 1000 has that decimal as its shortest repr (below 1e12 doubles are closer together than
     * 0.001, so no shorter decimal rounds to it). */
    if (fabs(value) < 1e12 && !(value == 0.0 && signbit(value))) {
        long long thousandths = llround(value * 1000.0);
        if ((double)thousandths / 1000.0 == value) {
            char text[32];
            char *end = text + sizeof text;
            unsigned long long magnitude = thousandths < 0 ? 0ULL - (unsigned long long)thousandths
                                                           : (unsigned long long)thousandths;
            unsigned long long fraction = magnitude % 1000;
            int width = 3;
            while (width > 1 && fraction % 10 == 0) {
                fraction /= 10;
                width--;
            }
            char *start = end;
            for (int i = 0; i < width; i++) {
                *--start = (char)('0' + fraction % 10);
                fraction /= 10;
            }
            *--start = '.';
            start = digits_before(start, magnitude / 1000);
            if (thousandths < 0) {
                *--start = '-';
            }
            buf_put(buf, start, (size_t)(end - start));
            return 0;
        }
    }
    char *repr = PyOS_double_to_string(value, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (repr == NULL) {
        return -1;
    }
    size_t len = strlen(repr);
    if (strchr(repr, 'e') != NULL || len > 40) {
        PyMem_Free(repr);
        return -1; /* msgspec writes exponents its own way: the Python path */
    }
    buf_put(buf, repr, len);
    PyMem_Free(repr);
    return 0;
}

/* A JSON string of UTF-8 that needs no escape; -1 (no exception) if it would need one. */
static int
put_utf8(Buf *buf, const char *utf8, Py_ssize_t len)
{
    for (Py_ssize_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)utf8[i];
        if (c < 0x20 || c == '"' || c == '\\') {
            return -1;
        }
    }
    if (buf_reserve(buf, (size_t)len + 2) < 0) {
        return -1;
    }
    buf->data[buf->len++] = '"';
    buf_put(buf, utf8, (size_t)len);
    buf->data[buf->len++] = '"';
    return 0;
}

/* put_utf8 of a str; -1 with an exception if it is not UTF-8 encodable. */
static int
put_string(Buf *buf, PyObject *text)
{
    Py_ssize_t len;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &len);
    if (utf8 == NULL) {
        return -1;
    }
    return put_utf8(buf, utf8, len);
}

/* -- ranking -------------------------------------------------------------------------------------- */

/* Python's str order: UTF-8 bytes compare in code point order. */
static inline int
compare_utf8(const char *a, Py_ssize_t a_len, const char *b, Py_ssize_t b_len)
{
    int order = memcmp(a, b, (size_t)(a_len < b_len ? a_len : b_len));
    if (order != 0) {
        return order;
    }
    return a_len < b_len ? -1 : a_len > b_len;
}

/* score_prefix's order: score and run descending, then pod id, dp rank and tier ascending. */
static int
compare_rows(const void *a_ptr, const void *b_ptr)
{
    const Row *a = a_ptr;
    const Row *b = b_ptr;
    if (a->score != b->score) {
        return a->score > b->score ? -1 : 1;
    }
    if (a->run != b->run) {
        return a->run > b->run ? -1 : 1;
    }
    if (a->pod_id != b->pod_id) {
        int order = compare_utf8(a->pod_utf8, a->pod_len, b->pod_utf8, b->pod_len);
        if (order != 0) {
            return order;
        }
    }
    if (a->dp_rank != b->dp_rank) {
        return a->dp_rank < b->dp_rank ? -1 : 1;
    }
    return a->tier == b->tier ? 0 : compare_utf8(a->tier_utf8, a->tier_len, b->tier_utf8, b->tier_len);
}

/* The exact int of a PyLong in [0, PY_SSIZE_T_MAX], else -1 (exception cleared). */
static Py_ssize_t
entry_id_of(PyObject *item)
{
    if (!PyLong_CheckExact(item)) {
        return -1;
    }
    Py_ssize_t value = PyLong_AsSsize_t(item);
    if (value < 0) {
        PyErr_Clear();
        return -1;
    }
    return value;
}

static int
same_holders(PyObject *a, PyObject *b)
{
    if (a == b) {
        return 1;
    }
    Py_ssize_t size = PyTuple_GET_SIZE(a);
    if (size != PyTuple_GET_SIZE(b)) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *x = PyTuple_GET_ITEM(a, i);
        PyObject *y = PyTuple_GET_ITEM(b, i);
        if (x != y && entry_id_of(x) != entry_id_of(y)) {
            return 0;
        }
    }
    return 1;
}

/* The list behind `entry_of` when it is a list's own __getitem__ (KVIndex.entry is its entry table's),
 * else NULL: its items are then read in place, not through a call per entry. */
static PyObject *
entry_table_of(PyObject *entry_of)
{
    if (!PyCFunction_Check(entry_of)) {
        return NULL;
    }
    PyObject *self = PyCFunction_GET_SELF(entry_of);
    if (self == NULL || !PyList_CheckExact(self)) {
        return NULL;
    }
    return strcmp(((PyCFunctionObject *)entry_of)->m_ml->ml_name, "__getitem__") == 0 ? self : NULL;
}

/* `table`'s entry for the id `item` if it is a (ref, tier) pair there (borrowed), else NULL. */
static inline PyObject *
table_pair(PyObject *table, PyObject *item)
{
    Py_ssize_t entry_id = entry_id_of(item);
    if (entry_id < 0 || entry_id >= PyList_GET_SIZE(table)) {
        return NULL;
    }
    PyObject *entry = PyList_GET_ITEM(table, entry_id);
    return PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 2 ? entry : NULL;
}

/* A new reference to entry `entry_id` (whose int is `item`): `table`'s item, or, outside it or without
 * it, `entry_of(item)`'s answer (an IndexError, as list.__getitem__ raises). NULL with an exception. */
static PyObject *
entry_at(PyObject *table, PyObject *entry_of, PyObject *item, Py_ssize_t entry_id)
{
    if (table != NULL && entry_id >= 0 && entry_id < PyList_GET_SIZE(table)) {
        return Py_NewRef(PyList_GET_ITEM(table, entry_id));
    }
    return PyObject_CallOneArg(entry_of, item);
}

static void
rows_free(Row *rows, Py_ssize_t n)
{
    if (rows == NULL) {
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(rows[i].pod_id);
        Py_XDECREF(rows[i].tier);
        Py_XDECREF(rows[i].state);
        Py_XDECREF(rows[i].age);
    }
    PyMem_Free(rows);
}

/* A row's pod (id and dp rank) from its (ref, tier) entry, and with `row` their UTF-8 too; 0 done, 1
 * decline, -1 error. */
static int
read_entry(Fields *fields, PyObject *entry, PyObject **pod_id, long long *dp_rank, Row *row)
{
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2) {
        return 1;
    }
    PyObject *ref = PyTuple_GET_ITEM(entry, 0);
    if (row != NULL) {
        row->tier = Py_NewRef(PyTuple_GET_ITEM(entry, 1));
        if (!PyUnicode_CheckExact(row->tier)) {
            return 1;
        }
        row->tier_utf8 = PyUnicode_AsUTF8AndSize(row->tier, &row->tier_len);
        if (row->tier_utf8 == NULL) {
            PyErr_Clear(); /* a lone surrogate: msgspec's path refuses it its own way */
            return 1;
        }
    }
    *pod_id = field_get(&fields->pod_id, ref);
    if (*pod_id == NULL) {
        return -1;
    }
    if (!PyUnicode_CheckExact(*pod_id)) {
        return 1;
    }
    if (row != NULL) {
        row->pod_utf8 = PyUnicode_AsUTF8AndSize(*pod_id, &row->pod_len);
        if (row->pod_utf8 == NULL) {
            PyErr_Clear();
            return 1;
        }
    }
    PyObject *rank = field_get(&fields->dp_rank, ref);
    if (rank == NULL) {
        return -1;
    }
    int overflow = 0;
    *dp_rank = PyLong_CheckExact(rank) ? PyLong_AsLongLongAndOverflow(rank, &overflow) : 0;
    int bad_rank = !PyLong_CheckExact(rank) || overflow || (*dp_rank == -1 && PyErr_Occurred());
    Py_DECREF(rank);
    if (bad_rank) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* The first block's n entries (new references into `entries`): `first_entries`' items, or with None,
 * each read by `entry_of` from its id. Read from an entry table, they are fetched level by level -- every
 * id's int, then every entry, its PodRef, its pod id -- before any is read: one after another, each was a
 * chain of four cache misses (~200 entries at 1,000 pods, cold after other processes ran: 45 us of an
 * answer). 0 done, -1 error. */
static int
read_first_entries(const Fields *fields, PyObject *first, Py_ssize_t n, PyObject *first_entries,
                   PyObject *entry_of, PyObject **entries)
{
    if (first_entries != Py_None) {
        for (Py_ssize_t i = 0; i < n; i++) {
            entries[i] = Py_NewRef(PyList_GET_ITEM(first_entries, i));
        }
        return 0;
    }
    PyObject *table = entry_table_of(entry_of);
    if (table != NULL) {
        Py_ssize_t size = PyList_GET_SIZE(table);
        for (Py_ssize_t i = 0; i < n; i++) {
            __builtin_prefetch(PyTuple_GET_ITEM(first, i));
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t entry_id = entry_id_of(PyTuple_GET_ITEM(first, i));
            if (entry_id >= 0 && entry_id < size) {
                __builtin_prefetch(PyList_GET_ITEM(table, entry_id));
            }
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *entry = table_pair(table, PyTuple_GET_ITEM(first, i));
            if (entry != NULL) {
                __builtin_prefetch(PyTuple_GET_ITEM(entry, 0));
            }
        }
        for (Py_ssize_t i = 0; i < n && fields->pod_id.type != NULL; i++) {
            PyObject *entry = table_pair(table, PyTuple_GET_ITEM(first, i));
            PyObject *pod_id = entry == NULL ? NULL : field_slot(&fields->pod_id, PyTuple_GET_ITEM(entry, 0));
            if (pod_id != NULL) {
                __builtin_prefetch(pod_id);
            }
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(first, i);
        entries[i] = entry_at(table, entry_of, item, entry_id_of(item));
        if (entries[i] == NULL) {
            return -1;
        }
    }
    return 0;
}

/* The pods of the answer's entries, by (pod id, dp rank): open addressing, holding a reference to each
 * pod id. */
typedef struct {
    PyObject **pod_ids;
    long long *dp_ranks;
    size_t mask;
    Py_ssize_t count;
} PodSet;

static int
pod_set_alloc(PodSet *set, size_t size)
{
    set->pod_ids = PyMem_Calloc(size, sizeof(PyObject *));
    set->dp_ranks = PyMem_Malloc(size * sizeof(long long));
    if (set->pod_ids == NULL || set->dp_ranks == NULL) {
        PyMem_Free(set->pod_ids);
        PyMem_Free(set->dp_ranks);
        set->pod_ids = NULL;
        set->dp_ranks = NULL;
        PyErr_NoMemory();
        return -1;
    }
    set->mask = size - 1;
    set->count = 0;
    return 0;
}

static void
pod_set_free(PodSet *set)
{
    if (set->pod_ids != NULL) {
        for (size_t i = 0; i <= set->mask; i++) {
            Py_XDECREF(set->pod_ids[i]);
        }
    }
    PyMem_Free(set->pod_ids);
    PyMem_Free(set->dp_ranks);
}

/* Adds the pod; 0 added, 1 it was there already, -1 error. */
static int
pod_set_add(PodSet *set, PyObject *pod_id, long long dp_rank)
{
    if ((size_t)(set->count + 1) * 2 > set->mask + 1) { /* grow: rebuild twice as large */
        PodSet bigger;
        if (pod_set_alloc(&bigger, (set->mask + 1) * 2) < 0) {
            return -1;
        }
        for (size_t i = 0; i <= set->mask; i++) {
            if (set->pod_ids[i] != NULL && pod_set_add(&bigger, set->pod_ids[i], set->dp_ranks[i]) < 0) {
                pod_set_free(&bigger);
                return -1;
            }
        }
        pod_set_free(set);
        *set = bigger;
    }
    Py_hash_t hash = PyObject_Hash(pod_id);
    if (hash == -1) {
        return -1;
    }
    size_t slot = ((size_t)hash ^ ((size_t)dp_rank * 0x9E3779B97F4A7C15ULL)) & set->mask;
    while (set->pod_ids[slot] != NULL) {
        PyObject *other = set->pod_ids[slot];
        if (set->dp_ranks[slot] == dp_rank && (other == pod_id || PyUnicode_Compare(other, pod_id) == 0)) {
            return 1;
        }
        slot = (slot + 1) & set->mask;
    }
    set->pod_ids[slot] = Py_NewRef(pod_id);
    set->dp_ranks[slot] = dp_rank;
    set->count++;
    return 0;
}

/* Each first-block entry's run: the leading blocks whose holders all include it.
 *
 * score_prefix scores per pod, summing each run's weight, whenever two entries anywhere in the lookup's
 * answer are one pod (two tiers of it), and those sums can round differently from weight x run: so
 * every entry of every block is looked at, and any such answer is declined (1). 0 done, -1 error. */
static int
find_runs(Fields *fields, Row *rows, Py_ssize_t n, PyObject *holder_ids, const IdMap *map, PodSet *pods,
          PyObject *entry_of)
{
    Py_ssize_t num_blocks = PyList_GET_SIZE(holder_ids);
    Py_ssize_t live = n; /* rows whose run goes on: live_rows[0..live) */
    Py_ssize_t position = 0;
    Py_ssize_t run_number = 0;
    Py_ssize_t block = 0;
    IdMap others = {NULL, NULL, 0};
    int outcome = 0;
    /* Only the rows still running are looked at after each run: a pass over every row per run was a
     * third of this writer's time on 512 blocks x 100 pods, where some row ends at nearly every run. */
    Py_ssize_t *live_rows = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(Py_ssize_t));
    if (live_rows == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t r = 0; r < n; r++) {
        live_rows[r] = r;
    }
    if (idmap_init(&others, 16) < 0) {
        PyMem_Free(live_rows);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t num_others = 0;
    PyObject *table = entry_table_of(entry_of);
    while (block < num_blocks) {
        PyObject *holders = PyList_GET_ITEM(holder_ids, block);
        Py_ssize_t end = block + 1;
        while (end < num_blocks && same_holders(PyList_GET_ITEM(holder_ids, end), holders)) {
            end++;
        }
        if (block > 0) {
            Py_ssize_t still_live = 0; /* rows still running among these holders */
            run_number++;
            Py_ssize_t size = PyTuple_GET_SIZE(holders);
            for (Py_ssize_t i = 0; i < size; i++) {
                Py_ssize_t entry_id = entry_id_of(PyTuple_GET_ITEM(holders, i));
                if (entry_id < 0) {
                    outcome = 1;
                    goto done;
                }
                Py_ssize_t row = idmap_get(map, entry_id);
                if (row >= 0) {
                    if (rows[row].seen != run_number) {
                        rows[row].seen = run_number;
                        still_live += rows[row].run < 0;
                    }
                    continue;
                }
                if (idmap_get(&others, entry_id) >= 0) {
                    continue;
                }
                if ((size_t)num_others * 2 >= others.mask) { /* grow: rebuild twice as large */
                    IdMap bigger = {NULL, NULL, 0};
                    if (idmap_init(&bigger, (Py_ssize_t)(others.mask + 1)) < 0) {
                        PyErr_NoMemory();
                        outcome = -1;
                        goto done;
                    }
                    for (size_t k = 0; k <= others.mask; k++) {
                        if (others.keys[k] != -1) {
                            idmap_add(&bigger, others.keys[k], 0);
                        }
                    }
                    idmap_free(&others);
                    others = bigger;
                }
                idmap_add(&others, entry_id, 0);
                num_others++;
                PyObject *entry = entry_at(table, entry_of, PyTuple_GET_ITEM(holders, i), entry_id);
                if (entry == NULL) {
                    outcome = -1;
                    goto done;
                }
                PyObject *pod_id = NULL;
                long long dp_rank = 0;
                outcome = read_entry(fields, entry, &pod_id, &dp_rank, NULL);
                if (outcome == 0) {
                    outcome = pod_set_add(pods, pod_id, dp_rank); /* 1: a second entry of one pod */
                }
                Py_XDECREF(pod_id);
                Py_DECREF(entry);
                if (outcome != 0) {
                    goto done;
                }
            }
            if (still_live < live) { /* some row is not among these holders: its run ends here */
                for (Py_ssize_t k = 0; k < live;) {
                    Py_ssize_t r = live_rows[k];
                    if (rows[r].seen != run_number) {
                        rows[r].run = position;
                        live_rows[k] = live_rows[--live];
                    } else {
                        k++;
                    }
                }
            }
        }
        position += end - block;
        block = end;
    }
    for (Py_ssize_t k = 0; k < live; k++) {
        rows[live_rows[k]].run = position;
    }
done:
    idmap_free(&others);
    PyMem_Free(live_rows);
    return outcome;
}

/* A row's score and health: from `health` (a PodHealth, or None: no stream feeds the pod), or, with
 * `live`, the state live at `live_age`. 0 done, 1 decline, -1 error. */
static int
fill_row(Fields *fields, Row *row, PyObject *health, int live, double live_age, PyObject *tier_weights,
         double unknown_weight, PyObject *states, PyObject *vouched, double grace_s, int by_score)
{
    double weight = unknown_weight;
    PyObject *found = PyDict_GetItemWithError(tier_weights, row->tier);
    if (found != NULL) {
        if (!PyFloat_CheckExact(found) && !PyLong_CheckExact(found)) {
            return 1;
        }
        weight = PyFloat_AsDouble(found);
        if (weight == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
    }
    else if (PyErr_Occurred()) {
        return -1;
    }
    row->score = weight * (double)row->run;
    if (!isfinite(row->score)) {
        return 1;
    }

    PyObject *down = NULL; /* how long the link has been down: a float, or None */
    if (live) {
        row->state = Py_NewRef(str_live);
        row->live_age = live_age;
        down = Py_NewRef(Py_None);
    }
    else if (health == Py_None) { /* no stream feeds it: the entry as the scorer made it */
        row->state = Py_NewRef(str_live);
        row->age = Py_NewRef(Py_None);
        row->group = 0;
        return 0;
    }
    else {
        row->state = field_get(&fields->state, health);
        if (row->state == NULL) {
            return -1;
        }
        row->age = field_get(&fields->age, health);
        if (row->age == NULL) {
            return -1;
        }
        if (!PyUnicode_CheckExact(row->state) || (row->age != Py_None && !PyFloat_CheckExact(row->age))) {
            return 1;
        }
        down = field_get(&fields->disconnected, health);
        if (down == NULL) {
            return -1;
        }
        if (down != Py_None && !PyFloat_CheckExact(down)) {
            Py_DECREF(down);
            return 1;
        }
    }
    int past_grace = down != Py_None && PyFloat_AS_DOUBLE(down) > grace_s;
    Py_DECREF(down);
    if (states != Py_None) {
        int kept = PySet_Contains(states, row->state);
        if (kept < 0) {
            return -1;
        }
        if (!kept) {
            row->group = -1;
            return 0;
        }
    }
    else if (past_grace) {
        row->group = -1;
        return 0;
    }
    if (by_score) {
        row->group = 0;
        return 0;
    }
    int is_vouched = PySet_Contains(vouched, row->state);
    if (is_vouched < 0) {
        return -1;
    }
    row->group = is_vouched ? 0 : 1;
    return 0;
}

/* -- a stream's health, read in place ---------------------------------------------------------------
 * IngestService.pod_healths' common case, on the Stream and SequenceTracker objects themselves (slots,
 * read by offset): an owned, connected, joined stream (the Stream's `joined`: its join is in the index)
 * with nothing flagged, heard from within
 * silent_after_s, is live. Anything else, and any field not of the expected type, is the service's to
 * judge (`slow`). */

typedef struct {
    PyObject *streams; /* dict: PodRef -> Stream */
    double now;
    double silent_after_s;
    int listen_up;      /* a bind-mode stream's link: some engine is connected to the bound SUB */
    int unowned_matter; /* replicas share a store: a stream this one does not own is not live here */
    PyObject *slow;     /* ref -> PodHealth | None */
} Reader;

/* 1 true, 0 false, -1 not a bool (or unreadable: the exception cleared). */
static int
field_flag(Field *field, PyObject *obj)
{
    PyObject *value = field_get(field, obj);
    if (value == NULL) {
        PyErr_Clear();
        return -1;
    }
    int flag = value == Py_True ? 1 : value == Py_False ? 0 : -1;
    Py_DECREF(value);
    return flag;
}

/* 1 with *age set if the stream is live by the common case, 0 if `slow` must judge it. */
static int
read_live(Fields *fields, const Reader *reader, PyObject *stream, double *age)
{
    PyObject *value = field_get(&fields->last_event_at, stream);
    if (value == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (!PyFloat_CheckExact(value)) {
        Py_DECREF(value);
        return 0;
    }
    double at = PyFloat_AS_DOUBLE(value);
    Py_DECREF(value);
    if (!(reader->now - at <= reader->silent_after_s)) {
        return 0;
    }
    int connect_mode = field_flag(&fields->connect_mode, stream);
    int connected = connect_mode == 1 ? field_flag(&fields->connected, stream) : reader->listen_up;
    if (connect_mode < 0 || connected != 1 || field_flag(&fields->hash_mismatch, stream) != 0) {
        return 0;
    }
    if (reader->unowned_matter && field_flag(&fields->owned, stream) != 1) {
        return 0;
    }
    if (field_flag(&fields->joined, stream) != 1) {
        return 0;
    }
    PyObject *tracker = field_get(&fields->tracker, stream);
    if (tracker == NULL) {
        PyErr_Clear();
        return 0;
    }
    int ok = field_flag(&fields->resyncing, tracker) == 0;
    Py_DECREF(tracker);
    if (!ok) {
        return 0;
    }
    /* age_ms: seconds to the millisecond, never negative (the same arithmetic as Python's). */
    long long thousandths = (long long)((reader->now - at) * 1000.0 + 0.5);
    *age = (double)(thousandths < 0 ? 0 : thousandths) / 1000.0;
    return 1;
}

/* The stream feeding `ref` (a new reference), or None; NULL on error. */
static PyObject *
reader_stream(const Reader *reader, PyObject *ref)
{
    PyObject *stream = PyDict_GetItemWithError(reader->streams, ref); /* borrowed */
    if (stream == NULL) {
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    return Py_NewRef(stream);
}

/* Ask for the cache lines read_live reads of a stream and its tracker. */
static void
prefetch_stream(const Fields *fields, PyObject *stream)
{
    if (stream == Py_None) {
        return;
    }
    __builtin_prefetch(stream);
    __builtin_prefetch((const char *)stream + 64);
    __builtin_prefetch((const char *)stream + 128);
    PyObject *tracker = field_slot(&fields->tracker, stream);
    if (tracker != NULL) {
        __builtin_prefetch(tracker);
        __builtin_prefetch((const char *)tracker + 64);
    }
    PyObject *at = field_slot(&fields->last_event_at, stream);
    if (at != NULL) {
        __builtin_prefetch(at);
    }
}

/* The health of the pod `ref`, fed by `stream` (None: no stream): 1 live at *age; 0 with *health (a new
 * reference: PodHealth or None); -1 error. */
static int
reader_health(Fields *fields, const Reader *reader, PyObject *ref, PyObject *stream, PyObject **health,
              double *age)
{
    if (stream == Py_None) {
        *health = Py_NewRef(Py_None);
        return 0;
    }
    if (read_live(fields, reader, stream, age)) {
        return 1;
    }
    *health = PyObject_CallOneArg(reader->slow, ref);
    return *health == NULL ? -1 : 0;
}

/* `,"name":value` (no comma first in the object); 0 done, 1 decline, -1 error. */
static int
put_tier(Buf *buf, int comma, const char *name, Py_ssize_t name_len, long long value)
{
    if (buf_reserve(buf, 1) < 0) {
        return -1;
    }
    if (comma) {
        PUT_LITERAL(buf, ",");
    }
    if (put_utf8(buf, name, name_len) < 0) {
        return PyErr_Occurred() ? -1 : 1;
    }
    if (buf_reserve(buf, 32) < 0) {
        return -1;
    }
    PUT_LITERAL(buf, ":");
    put_int(buf, value);
    return 0;
}

/* Writes one entry; 0 done, 1 decline, -1 error. */
static int
put_row(Buf *buf, const Row *row, long long block_size, PyObject *report_tiers)
{
    Py_ssize_t num_report = PyTuple_GET_SIZE(report_tiers);
    if (buf_reserve(buf, 160) < 0) {
        return -1;
    }
    PUT_LITERAL(buf, "{\"pod\":");
    if (put_utf8(buf, row->pod_utf8, row->pod_len) < 0) {
        return PyErr_Occurred() ? -1 : 1;
    }
    if (buf_reserve(buf, 160) < 0) {
        return -1;
    }
    PUT_LITERAL(buf, ",\"dp_rank\":");
    put_int(buf, row->dp_rank);
    PUT_LITERAL(buf, ",\"matched_blocks\":");
    put_int(buf, (long long)row->run);
    PUT_LITERAL(buf, ",\"matched_tokens\":");
    put_int(buf, (long long)row->run * block_size);
    PUT_LITERAL(buf, ",\"score\":");
    if (put_float(buf, row->score) < 0) {
        return PyErr_Occurred() ? -1 : 1;
    }
    PUT_LITERAL(buf, ",\"by_tier\":{");
    int tier_reported = 0;
    for (Py_ssize_t i = 0; i < num_report; i++) {
        PyObject *name = PyTuple_GET_ITEM(report_tiers, i);
        Py_ssize_t name_len;
        const char *name_utf8 = PyUnicode_AsUTF8AndSize(name, &name_len);
        if (name_utf8 == NULL) {
            PyErr_Clear(); /* not UTF-8 encodable: msgspec's path refuses it its own way */
            return 1;
        }
        int is_tier = name == row->tier || compare_utf8(name_utf8, name_len, row->tier_utf8, row->tier_len) == 0;
        tier_reported |= is_tier;
        int put = put_tier(buf, i > 0, name_utf8, name_len, is_tier ? (long long)row->run : 0);
        if (put != 0) {
            return put;
        }
    }
    if (!tier_reported) {
        int put = put_tier(buf, num_report > 0, row->tier_utf8, row->tier_len, (long long)row->run);
        if (put != 0) {
            return put;
        }
    }
    PUT_LITERAL(buf, "},\"state\":");
    if (put_string(buf, row->state) < 0) {
        return PyErr_Occurred() ? -1 : 1;
    }
    if (buf_reserve(buf, 64) < 0) {
        return -1;
    }
    PUT_LITERAL(buf, ",\"last_event_age_s\":");
    if (row->age == NULL) {
        if (put_float(buf, row->live_age) < 0) {
            return PyErr_Occurred() ? -1 : 1;
        }
    }
    else if (row->age == Py_None) {
        PUT_LITERAL(buf, "null");
    }
    else if (put_float(buf, PyFloat_AS_DOUBLE(row->age)) < 0) {
        return PyErr_Occurred() ? -1 : 1;
    }
    PUT_LITERAL(buf, "}");
    return 0;
}

/* A compact answer's entry, [pod, dp_rank, matched_blocks, score] (schemas.CompactPodScore): what msgspec
 * writes for that tuple; 0 done, 1 decline, -1 error. */
static int
put_compact_row(Buf *buf, const Row *row)
{
    if (buf_reserve(buf, 8) < 0) {
        return -1;
    }
    PUT_LITERAL(buf, "[");
    if (put_utf8(buf, row->pod_utf8, row->pod_len) < 0) {
        return PyErr_Occurred() ? -1 : 1;
    }
    if (buf_reserve(buf, 96) < 0) {
        return -1;
    }
    PUT_LITERAL(buf, ",");
    put_int(buf, row->dp_rank);
    PUT_LITERAL(buf, ",");
    put_int(buf, (long long)row->run);
    PUT_LITERAL(buf, ",");
    if (put_float(buf, row->score) < 0) {
        return PyErr_Occurred() ? -1 : 1;
    }
    PUT_LITERAL(buf, "]");
    return 0;
}

PyDoc_STRVAR(encode_scores_doc,
             "encode_scores(holder_ids, first_entries, entry_of, healths, tier_weights, unknown_tier_weight,\n"
             "              block_size, report_tiers, states, vouched_states, grace_s, by_score, compact, /)\n"
             "--\n\n"
             "The JSON of a score answer's `scores` list and its best matched_blocks, or None when the\n"
             "Python path must build it (see the module's docstring). `first_entries`: the first block's\n"
             "entries, or None to read them by `entry_of`. `healths`: the first block's pods' PodHealth (or\n"
             "None), in its holders' order, or a HealthReader to read them from the streams.\n"
             "`compact`: each entry as [pod, dp_rank, matched_blocks, score] instead of an object.");

/* 0 to go on; else the value to return (None: declined; NULL: error). */
#define DECLINE_OR_FAIL(outcome) ((outcome) > 0 ? Py_NewRef(Py_None) : NULL)

static PyObject *
encode_scores(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 13) {
        PyErr_Format(PyExc_TypeError, "encode_scores takes 13 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *holder_ids = args[0], *first_entries = args[1], *entry_of = args[2], *healths = args[3];
    PyObject *tier_weights = args[4], *report_tiers = args[7], *states = args[8], *vouched = args[9];
    Reader reader = {NULL, 0.0, 0.0, 0, 0, NULL};
    int use_reader = 0;
    if (PyTuple_Check(healths) && PyTuple_GET_SIZE(healths) == 6) { /* a HealthReader */
        reader.streams = PyTuple_GET_ITEM(healths, 0);
        reader.now = PyFloat_AsDouble(PyTuple_GET_ITEM(healths, 1));
        reader.silent_after_s = PyFloat_AsDouble(PyTuple_GET_ITEM(healths, 2));
        reader.listen_up = PyObject_IsTrue(PyTuple_GET_ITEM(healths, 3));
        reader.unowned_matter = PyObject_IsTrue(PyTuple_GET_ITEM(healths, 4));
        reader.slow = PyTuple_GET_ITEM(healths, 5);
        if (PyErr_Occurred() || reader.listen_up < 0 || reader.unowned_matter < 0) {
            return NULL;
        }
        if (!PyDict_Check(reader.streams) || !PyCallable_Check(reader.slow)) {
            Py_RETURN_NONE;
        }
        use_reader = 1;
    }
    else if (!PyList_CheckExact(healths)) {
        Py_RETURN_NONE;
    }
    if (!PyList_CheckExact(holder_ids) || (first_entries != Py_None && !PyList_CheckExact(first_entries)) ||
        !PyCallable_Check(entry_of) || !PyDict_Check(tier_weights) || !PyTuple_CheckExact(report_tiers) ||
        !PyAnySet_Check(vouched) || (states != Py_None && !PyAnySet_Check(states))) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(report_tiers); i++) {
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(report_tiers, i))) {
            Py_RETURN_NONE;
        }
    }
    double unknown_weight = PyFloat_AsDouble(args[5]);
    long long block_size = PyLong_AsLongLong(args[6]);
    double grace_s = PyFloat_AsDouble(args[10]);
    int by_score = PyObject_IsTrue(args[11]);
    int compact = PyObject_IsTrue(args[12]);
    if (PyErr_Occurred() || by_score < 0 || compact < 0) {
        return NULL;
    }
    if (block_size < 1 || block_size > (1LL << 24)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t num_blocks = PyList_GET_SIZE(holder_ids);
    if (num_blocks == 0) {
        return Py_BuildValue("(y#i)", "[]", (Py_ssize_t)2, 0);
    }
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
        if (!PyTuple_CheckExact(PyList_GET_ITEM(holder_ids, b))) {
            Py_RETURN_NONE;
        }
    }
    PyObject *first = PyList_GET_ITEM(holder_ids, 0);
    Py_ssize_t n = PyTuple_GET_SIZE(first);
    if (n == 0 || (first_entries != Py_None && PyList_GET_SIZE(first_entries) != n) ||
        (!use_reader && PyList_GET_SIZE(healths) != n)) {
        Py_RETURN_NONE;
    }

    PyObject *result = NULL;
    Fields *fields = &answer_fields;
    IdMap map = {NULL, NULL, 0};
    PodSet pods = {NULL, NULL, 0, 0};
    Buf buf = {NULL, 0, 0};
    PyObject **streams = NULL; /* with a reader: each row's stream (new references), or None */
    PyObject **entries = NULL; /* the first block's entries (new references) */
    int outcome = 0;
    Row *rows = PyMem_Calloc((size_t)n, sizeof(Row));
    if (rows == NULL) {
        return PyErr_NoMemory();
    }
    entries = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    if (entries == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_first_entries(fields, first, n, first_entries, entry_of, entries) < 0) {
        goto done;
    }
    if (idmap_init(&map, n) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t entry_id = entry_id_of(PyTuple_GET_ITEM(first, i));
        if (entry_id < 0 || !idmap_add(&map, entry_id, i)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        rows[i].entry_id = entry_id;
        rows[i].run = -1;
        outcome = read_entry(fields, entries[i], &rows[i].pod_id, &rows[i].dp_rank, &rows[i]);
        if (outcome != 0) {
            result = DECLINE_OR_FAIL(outcome);
            goto done;
        }
    }
    size_t pod_slots = 16; /* room for every first-block pod at half load: no rebuild while they go in */
    while (pod_slots < (size_t)n * 2 + 2) {
        pod_slots *= 2;
    }
    if (pod_set_alloc(&pods, pod_slots) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n && outcome == 0; i++) {
        outcome = pod_set_add(&pods, rows[i].pod_id, rows[i].dp_rank); /* 1: a pod on two tiers */
    }
    if (outcome == 0) {
        outcome = find_runs(fields, rows, n, holder_ids, &map, &pods, entry_of);
    }
    if (outcome != 0) {
        result = DECLINE_OR_FAIL(outcome);
        goto done;
    }
    if (use_reader) {
        /* Every row's stream is looked up and its lines asked for before any is read: one after another,
         * each row's reads were a chain of cache misses (~100 streams, cold after other processes ran). */
        streams = PyMem_Calloc((size_t)n, sizeof(PyObject *));
        if (streams == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *ref = PyTuple_GET_ITEM(entries[i], 0); /* read_entry checked it */
            streams[i] = reader_stream(&reader, ref);
            if (streams[i] == NULL) {
                goto done;
            }
            prefetch_stream(fields, streams[i]);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *health = NULL;
        int live = 0;
        double age = 0.0;
        if (use_reader) {
            PyObject *ref = PyTuple_GET_ITEM(entries[i], 0);
            live = reader_health(fields, &reader, ref, streams[i], &health, &age);
            if (live < 0) {
                goto done;
            }
        }
        else {
            health = Py_NewRef(PyList_GET_ITEM(healths, i));
        }
        outcome = fill_row(fields, &rows[i], health, live, age, tier_weights, unknown_weight, states, vouched,
                           grace_s, by_score);
        Py_XDECREF(health);
        if (outcome != 0) {
            result = DECLINE_OR_FAIL(outcome);
            goto done;
        }
    }
    qsort(rows, (size_t)n, sizeof(Row), compare_rows);

    if (buf_reserve(&buf, (size_t)n * 192 + 2) < 0) {
        goto done;
    }
    PUT_LITERAL(&buf, "[");
    long long best = -1;
    for (int group = 0; group < 2; group++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (rows[i].group != group) {
                continue;
            }
            if (best >= 0) {
                if (buf_reserve(&buf, 1) < 0) {
                    goto done;
                }
                PUT_LITERAL(&buf, ",");
            }
            else {
                best = rows[i].run;
            }
            outcome = compact ? put_compact_row(&buf, &rows[i]) : put_row(&buf, &rows[i], block_size, report_tiers);
            if (outcome != 0) {
                result = DECLINE_OR_FAIL(outcome);
                goto done;
            }
        }
    }
    if (buf_reserve(&buf, 1) < 0) {
        goto done;
    }
    PUT_LITERAL(&buf, "]");
    result = Py_BuildValue("(y#L)", buf.data, (Py_ssize_t)buf.len, best < 0 ? 0LL : best);

done:
    if (streams != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_XDECREF(streams[i]);
        }
        PyMem_Free(streams);
    }
    if (entries != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_XDECREF(entries[i]);
        }
        PyMem_Free(entries);
    }
    rows_free(rows, n);
    idmap_free(&map);
    pod_set_free(&pods);
    PyMem_Free(buf.data);
    return result;
}

static PyMethodDef answer_methods[] = {
    {"encode_scores", (PyCFunction)(void (*)(void))encode_scores, METH_FASTCALL, encode_scores_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef answer_module = {
    PyModuleDef_HEAD_INIT,
    "kvindex.api._answer",
    "A score answer's entries ranked and written as JSON without a Python object per entry.",
    0,
    answer_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__answer(void)
{
    str_pod_id = PyUnicode_InternFromString("pod_id");
    str_dp_rank = PyUnicode_InternFromString("dp_rank");
    str_state = PyUnicode_InternFromString("state");
    str_age = PyUnicode_InternFromString("last_event_age_s");
    str_disconnected = PyUnicode_InternFromString("disconnected_for_s");
    str_live = PyUnicode_InternFromString("live");
    str_last_event_at = PyUnicode_InternFromString("last_event_at");
    str_connect_mode = PyUnicode_InternFromString("connect_mode");
    str_connected = PyUnicode_InternFromString("connected");
    str_hash_mismatch = PyUnicode_InternFromString("hash_mismatch");
    str_owned = PyUnicode_InternFromString("owned");
    str_tracker = PyUnicode_InternFromString("tracker");
    str_joined = PyUnicode_InternFromString("joined");
    str_resyncing = PyUnicode_InternFromString("resyncing");
    if (!str_pod_id || !str_dp_rank || !str_state || !str_age || !str_disconnected || !str_live ||
        !str_last_event_at || !str_connect_mode || !str_connected || !str_hash_mismatch || !str_owned ||
        !str_tracker || !str_joined || !str_resyncing) {
        return NULL;
    }
    fields_init(&answer_fields);
    return PyModule_Create(&answer_module);
}
