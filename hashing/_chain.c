/* kvindex.hashing._chain: the compiled core of vLLM's block-hash chain, for all four of its algorithms.
 *
 * For blocks without extra keys, digest_i = H(serialize((parent, tuple(block_i tokens), None))),
 * parent = digest_{i-1} (or the caller's digest for block 0), where serialize is pickle.dumps(protocol=5)
 * or cbor2.dumps(canonical=True). The preimage bytes are built here exactly as those serialisers build
 * them (hashing/hasher.py stays the reference; tests/hashing/test_compiled.py proves equality). H is
 * SHA-256, through OpenSSL's libcrypto (the same SHA-256 hashlib uses), or the caller's digest function:
 * the xxhash algorithms pass xxhash.xxh3_128_digest, the very function vLLM calls, once per block.
 *
 * Anything this encoder does not reproduce returns None, so the caller runs the pure-Python path:
 * a token that is not an exact int in [0, 2**64), a parent of 256 bytes or more, or a block so long that
 * pickle would split it into several frames.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* SHA-256 through OpenSSL's low-level SHA256_Init/Update/Final where the library still has them (every
 * OpenSSL 3 built with its deprecated APIs, as distributions ship it): EVP's provider dispatch costs about
 * 90 ns a call, 186 against 97 ns for a 110-byte preimage on this box -- 40% of a block's hashing. Both
 * run the same assembly. A libcrypto built without deprecated APIs gets the EVP path. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/opensslconf.h>
#if !defined(OPENSSL_NO_DEPRECATED_3_0)
#define KVI_LOW_LEVEL_SHA256 1
#include <openssl/sha.h>
#endif
#include <openssl/evp.h>
#include <stdint.h>
#include <string.h>

#define DIGEST_SIZE 32
/* pickle starts a new frame once one reaches 64 KiB; below this many tokens (at most 11 bytes each) a
 * preimage always fits in one frame. vLLM's hash block sizes are far smaller. */
#define MAX_BLOCK_SIZE 4096
#define MAX_PARENT_SIZE 255
/* Preimage bytes besides the tokens: pickle's header, frame, parent opcode and tail; more than CBOR's. */
#define PREIMAGE_OVERHEAD (11 + 2 + MAX_PARENT_SIZE + 1 + 1 + 2 + 4 + 1)
/* Below this many blocks, dropping and re-taking the GIL costs more than it lets other threads do. */
#define RELEASE_GIL_BLOCKS 8

static EVP_MD *sha256_md = NULL;

/* ---- pickle protocol 5, as CPython's _pickle.c writes (parent, tokens, None) ---- */

/* Four bytes at out: `value` little-endian (le) or big-endian. Callers leave room past what they keep. */
static void
store32(unsigned char *out, uint32_t value, int little_endian)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    if (little_endian) {
        value = __builtin_bswap32(value);
    }
#else
    if (!little_endian) {
        value = __builtin_bswap32(value);
    }
#endif
    memcpy(out, &value, sizeof value);
}

/* An id's pickle opcode and the bytes it keeps, by size class (<= 0xff, <= 0xffff, < 2**31). */
static const unsigned char BININT_OPCODE[3] = {'K', 'M', 'J'};
static const unsigned char BININT_LENGTH[3] = {2, 3, 5};

static unsigned char *
pickle_int(unsigned char *out, uint64_t value)
{
    int nbits;
    int nbytes;
    int i;

    if (value <= 0x7fffffff) {
        /* BININT1, BININT2 or BININT (a signed 4-byte int), without a branch on the size: ids of every
         * size mix in a prompt, and the mispredicted branches were most of the serialising. Four value
         * bytes are always written; the next id overwrites what its opcode does not keep. */
        int size_class = (value > 0xff) + (value > 0xffff);
        out[0] = BININT_OPCODE[size_class];
        store32(out + 1, (uint32_t)value, 1);
        return out + BININT_LENGTH[size_class];
    }
    /* LONG1: little-endian two's complement, (bit length // 8) + 1 bytes, as save_long sizes it. */
    nbits = 64 - __builtin_clzll(value);
    nbytes = nbits / 8 + 1;
    *out++ = 0x8a;
    *out++ = (unsigned char)nbytes;
    for (i = 0; i < nbytes; i++) {
        *out++ = i < 8 ? (unsigned char)(value >> (8 * i)) : 0;
    }
    return out;
}

static size_t
pickle_preimage(unsigned char *buf, const unsigned char *parent, size_t parent_size,
                const uint64_t *tokens, Py_ssize_t block_size)
{
    unsigned char *out = buf + 11; /* PROTO 5, then FRAME and its 8-byte length, filled in below */
    uint64_t frame_size;
    Py_ssize_t i;
    int k;

    *out++ = 'C'; /* SHORT_BINBYTES, then MEMOIZE: bytes are memoised */
    *out++ = (unsigned char)parent_size;
    memcpy(out, parent, parent_size);
    out += parent_size;
    *out++ = 0x94;
    if (block_size > 3) {
        *out++ = '('; /* MARK: tuples of more than 3 items end in TUPLE */
    }
    for (i = 0; i < block_size; i++) {
        out = pickle_int(out, tokens[i]);
    }
    /* TUPLE1..3 (0x85..0x87) or TUPLE; the token tuple is memoised, then None and the outer TUPLE3 */
    *out++ = block_size <= 3 ? (unsigned char)(0x84 + block_size) : 't';
    *out++ = 0x94;
    *out++ = 'N';
    *out++ = 0x87;
    *out++ = 0x94;
    *out++ = '.';
    buf[0] = 0x80;
    buf[1] = 5;
    buf[2] = 0x95;
    frame_size = (uint64_t)(out - (buf + 11));
    for (k = 0; k < 8; k++) {
        buf[3 + k] = (unsigned char)(frame_size >> (8 * k));
    }
    return (size_t)(out - buf);
}

/* ---- canonical CBOR, as cbor2.dumps(canonical=True) writes [parent, [tokens...], null] ---- */

static unsigned char *
cbor_head(unsigned char *out, unsigned char major, uint64_t value)
{
    int width;
    int i;

    if (value < 24) {
        *out++ = major | (unsigned char)value;
        return out;
    }
    if (value <= 0xff) {
        *out++ = major | 24;
        width = 1;
    }
    else if (value <= 0xffff) {
        *out++ = major | 25;
        width = 2;
    }
    else if (value <= 0xffffffffULL) {
        *out++ = major | 26;
        width = 4;
    }
    else {
        *out++ = major | 27;
        width = 8;
    }
    for (i = width - 1; i >= 0; i--) { /* big-endian */
        *out++ = (unsigned char)(value >> (8 * i));
    }
    return out;
}

/* By size class (< 24, <= 0xff, <= 0xffff, < 2**32): the head's additional info (class 0: the value
 * itself), the value bytes kept, and the shift that moves them to the top of 32 bits. */
static const unsigned char CBOR_INFO[4] = {0, 24, 25, 26};
static const unsigned char CBOR_WIDTH[4] = {0, 1, 2, 4};
static const unsigned char CBOR_SHIFT[4] = {32, 24, 16, 0};

/* cbor_head(out, 0x00, value) for an unsigned id, without a branch on its size below 2**32 (as pickle_int);
 * writes up to 4 bytes past what it keeps. */
static unsigned char *
cbor_uint(unsigned char *out, uint64_t value)
{
    if (value > 0xffffffffULL) {
        return cbor_head(out, 0x00, value);
    }
    int size_class = (value >= 24) + (value > 0xff) + (value > 0xffff);
    out[0] = size_class ? CBOR_INFO[size_class] : (unsigned char)value;
    store32(out + 1, (uint32_t)(value << CBOR_SHIFT[size_class]), 0);
    return out + 1 + CBOR_WIDTH[size_class];
}

static size_t
cbor_preimage(unsigned char *buf, const unsigned char *parent, size_t parent_size,
              const uint64_t *tokens, Py_ssize_t block_size)
{
    unsigned char *out = buf;
    Py_ssize_t i;

    *out++ = 0x83; /* array of 3 */
    out = cbor_head(out, 0x40, parent_size);
    memcpy(out, parent, parent_size);
    out += parent_size;
    out = cbor_head(out, 0x80, (uint64_t)block_size);
    for (i = 0; i < block_size; i++) {
        out = cbor_uint(out, tokens[i]);
    }
    *out++ = 0xf6; /* null */
    return (size_t)(out - buf);
}

/* ---- the chain ---- */

typedef struct {
    const uint64_t *tokens;
    Py_ssize_t block_size;
    Py_ssize_t num_blocks;
    int cbor;
    const unsigned char *parent;
    size_t parent_size;
    unsigned char *preimage; /* scratch: one block's serialised bytes */
    unsigned char *digests;  /* out: num_blocks * DIGEST_SIZE bytes */
} chain_job;

/* Runs without the GIL: touches only the job's C buffers. 0 on success, -1 if OpenSSL failed. */
static int
run_chain(const chain_job *job)
{
#ifdef KVI_LOW_LEVEL_SHA256
    SHA256_CTX ctx;
    int ok = 1;
#else
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int ok = ctx != NULL;
#endif
    const unsigned char *parent = job->parent;
    size_t parent_size = job->parent_size;
    Py_ssize_t b;

    for (b = 0; ok && b < job->num_blocks; b++) {
        const uint64_t *block = job->tokens + b * job->block_size;
        unsigned char *digest = job->digests + b * DIGEST_SIZE;
        size_t size = job->cbor
            ? cbor_preimage(job->preimage, parent, parent_size, block, job->block_size)
            : pickle_preimage(job->preimage, parent, parent_size, block, job->block_size);
#ifdef KVI_LOW_LEVEL_SHA256
        ok = SHA256_Init(&ctx) && SHA256_Update(&ctx, job->preimage, size) && SHA256_Final(digest, &ctx);
#else
        ok = EVP_DigestInit_ex(ctx, sha256_md, NULL) && EVP_DigestUpdate(ctx, job->preimage, size)
            && EVP_DigestFinal_ex(ctx, digest, NULL);
#endif
        parent = digest;
        parent_size = DIGEST_SIZE;
    }
#ifndef KVI_LOW_LEVEL_SHA256
    EVP_MD_CTX_free(ctx);
#endif
    return ok ? 0 : -1;
}

/* An exact int's value if it is non-negative and below 2**30 (one digit, every token id in use), read
 * in place; -1 for anything else, which then takes the general conversion. Saves a call per token. */
static long
small_value(PyObject *item)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t value = PyUnstable_Long_CompactValue((PyLongObject *)item);
        return value >= 0 ? (long)value : -1;
    }
    return -1;
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size == 0) {
        return 0;
    }
    return size == 1 ? (long)((PyLongObject *)item)->ob_digit[0] : -1;
#endif
}

/* The int objects of a prompt fresh from a JSON decode lie scattered over the heap, and reading them is
 * most of packing a memoised prompt: each loop over them fetches the object PREFETCH_IDS ids ahead, so the
 * misses overlap. 64 measured best (hot sha256 workload, alternating with vLLM's formula: +14% blocks/s;
 * 8, 16, 32 and 128 gained less). */
#define PREFETCH_IDS 64

/* A macro, not a static inline function: GCC 12 -O2 emitted no prefetch at all for the function once it
 * had more than one caller. */
#define PREFETCH_ID(items, i, count)                                                                        \
    do {                                                                                                   \
        if ((i) + PREFETCH_IDS < (count)) {                                                                \
            __builtin_prefetch((items)[(i) + PREFETCH_IDS]);                                               \
        }                                                                                                  \
    } while (0)

/* The token ids as uint64; 0 on success, 1 if one is not an exact int in [0, 2**64) (no exception). */
static int
read_tokens(PyObject *const *items, Py_ssize_t count, uint64_t *out)
{
    Py_ssize_t i;

    for (i = 0; i < count; i++) {
        PREFETCH_ID(items, i, count);
        if (!PyLong_CheckExact(items[i])) {
            return 1;
        }
        long small = small_value(items[i]);
        out[i] = small >= 0 ? (uint64_t)small : PyLong_AsUnsignedLongLong(items[i]);
        if (out[i] == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear(); /* negative or >= 2**64 */
            return 1;
        }
    }
    return 0;
}

static PyObject *
digest_list(const unsigned char *digests, Py_ssize_t num_blocks)
{
    PyObject *list = PyList_New(num_blocks);
    Py_ssize_t b;

    if (list == NULL) {
        return NULL;
    }
    for (b = 0; b < num_blocks; b++) {
        PyObject *item = PyBytes_FromStringAndSize((const char *)digests + b * DIGEST_SIZE, DIGEST_SIZE);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, b, item);
    }
    return list;
}

/* Hashes the job's blocks (its tokens and buffers already set) and returns their digests as a list. */
static PyObject *
finish_chain(chain_job *job)
{
    int failed;

    if (job->num_blocks >= RELEASE_GIL_BLOCKS) {
        Py_BEGIN_ALLOW_THREADS
        failed = run_chain(job);
        Py_END_ALLOW_THREADS
    }
    else {
        failed = run_chain(job);
    }
    if (failed) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL's SHA-256 failed");
        return NULL;
    }
    return digest_list(job->digests, job->num_blocks);
}

/* The job's chain with `digest` (a Python callable: preimage bytes -> digest bytes) as H, under the GIL:
 * each block's digest object goes straight into the result list and is the next block's parent. */
static PyObject *
digest_chain(const chain_job *job, PyObject *digest)
{
    PyObject *list = PyList_New(job->num_blocks);
    const unsigned char *parent = job->parent;
    size_t parent_size = job->parent_size;
    Py_ssize_t b;

    if (list == NULL) {
        return NULL;
    }
    for (b = 0; b < job->num_blocks; b++) {
        const uint64_t *block = job->tokens + b * job->block_size;
        size_t size = job->cbor
            ? cbor_preimage(job->preimage, parent, parent_size, block, job->block_size)
            : pickle_preimage(job->preimage, parent, parent_size, block, job->block_size);
        PyObject *data = PyBytes_FromStringAndSize((const char *)job->preimage, (Py_ssize_t)size);
        if (data == NULL) {
            goto fail;
        }
        PyObject *found = PyObject_CallOneArg(digest, data);
        Py_DECREF(data);
        if (found == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(list, b, found);
        /* The next preimage writes it as a parent: bytes that pickle writes as SHORT_BINBYTES. */
        if (!PyBytes_CheckExact(found) || PyBytes_GET_SIZE(found) > MAX_PARENT_SIZE) {
            PyErr_Format(PyExc_TypeError, "the digest function must return bytes of at most %d bytes, got %R",
                         MAX_PARENT_SIZE, found);
            goto fail;
        }
        parent = (const unsigned char *)PyBytes_AS_STRING(found);
        parent_size = (size_t)PyBytes_GET_SIZE(found);
    }
    return list;
fail:
    Py_DECREF(list); /* unset items are NULL, which list_dealloc skips */
    return NULL;
}

/* The chain of num_blocks blocks whose ids are `items` (exact ints, checked here) or, with items NULL,
 * `packed` (native uint32: exact by construction); H is SHA-256, or `digest` unless it is None. */
static PyObject *
chain_impl(PyObject *parent_obj, PyObject *const *items, const char *packed, Py_ssize_t block_size,
           Py_ssize_t num_blocks, int cbor, PyObject *digest)
{
    Py_ssize_t count = num_blocks * block_size;
    size_t preimage_cap = PREIMAGE_OVERHEAD + 11 * (size_t)block_size;
    uint64_t *tokens = NULL;
    unsigned char *scratch = NULL;
    PyObject *result = NULL;
    chain_job job;

    tokens = PyMem_Malloc(count > 0 ? (size_t)count * sizeof(uint64_t) : 1);
    /* The SHA-256 digests land in scratch; a digest function's are Python bytes from the start. */
    scratch = PyMem_Malloc(preimage_cap + (digest == Py_None ? (size_t)num_blocks * DIGEST_SIZE : 0));
    if (tokens == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (items == NULL) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t id;
            memcpy(&id, packed + i * (Py_ssize_t)sizeof(uint32_t), sizeof id);
            tokens[i] = id;
        }
    }
    else if (read_tokens(items, count, tokens)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    job.tokens = tokens;
    job.block_size = block_size;
    job.num_blocks = num_blocks;
    job.cbor = cbor;
    job.parent = (const unsigned char *)PyBytes_AS_STRING(parent_obj);
    job.parent_size = (size_t)PyBytes_GET_SIZE(parent_obj);
    job.preimage = scratch;
    job.digests = scratch + preimage_cap;
    result = digest == Py_None ? finish_chain(&job) : digest_chain(&job, digest);
done:
    PyMem_Free(tokens);
    PyMem_Free(scratch);
    return result;
}

/* The optional trailing digest argument of chain() / chain_packed() (`name`), at args[at]: None when absent;
 * NULL with a TypeError when it is neither None nor callable. */
static PyObject *
digest_argument(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t at)
{
    if (nargs != at && nargs != at + 1) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd or %zd positional arguments (%zd given)", name, at, at + 1,
                     nargs);
        return NULL;
    }
    PyObject *digest = nargs > at ? args[at] : Py_None;
    if (digest != Py_None && !PyCallable_Check(digest)) {
        PyErr_Format(PyExc_TypeError, "%s() wants a callable digest or None", name);
        return NULL;
    }
    return digest;
}

PyDoc_STRVAR(chain_doc,
"chain(parent, tokens, block_size, num_blocks, cbor, digest=None, /)\n--\n\n"
"SHA-256 digests of the first num_blocks blocks of block_size tokens (a list or tuple), chained from\n"
"parent, with no extra keys: pickle protocol 5 preimages, or canonical CBOR ones if cbor is true.\n"
"With a digest function (preimage bytes -> digest bytes), its digests instead.\n"
"None when a token is not an exact int in [0, 2**64), parent has 256 bytes or more, or block_size\n"
"exceeds 4096: the pure-Python path handles those.");

static PyObject *
chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t block_size;
    Py_ssize_t num_blocks;
    int cbor;

    (void)module;
    PyObject *digest = digest_argument("chain", args, nargs, 5); /* borrowed */
    if (digest == NULL) {
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || !(PyList_CheckExact(args[1]) || PyTuple_CheckExact(args[1]))) {
        PyErr_SetString(PyExc_TypeError, "chain() wants parent bytes and a list or tuple of tokens");
        return NULL;
    }
    block_size = PyLong_AsSsize_t(args[2]);
    if (block_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    num_blocks = PyLong_AsSsize_t(args[3]);
    if (num_blocks == -1 && PyErr_Occurred()) {
        return NULL;
    }
    cbor = PyObject_IsTrue(args[4]);
    if (cbor < 0) {
        return NULL;
    }
    if (block_size < 1 || num_blocks < 0 || num_blocks > PySequence_Fast_GET_SIZE(args[1]) / block_size) {
        PyErr_SetString(PyExc_ValueError, "chain() wants block_size >= 1 and 0 <= num_blocks <= len // block_size");
        return NULL;
    }
    if (block_size > MAX_BLOCK_SIZE || PyBytes_GET_SIZE(args[0]) > MAX_PARENT_SIZE) {
        Py_RETURN_NONE;
    }
    return chain_impl(args[0], PySequence_Fast_ITEMS(args[1]), NULL, block_size, num_blocks, cbor, digest);
}

PyDoc_STRVAR(chain_packed_doc,
"chain_packed(parent, token_bytes, first, block_size, num_blocks, cbor, digest=None, /)\n--\n\n"
"chain() of the num_blocks blocks starting at token `first` of token_bytes, ids packed as native uint32\n"
"(array('I').tobytes(), which every id fits): the score path's packed ids, hashed without a list of\n"
"ints. None when parent has 256 bytes or more or block_size exceeds 4096.");

static PyObject *
chain_packed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t first, block_size, num_blocks;
    int cbor;

    (void)module;
    PyObject *digest = digest_argument("chain_packed", args, nargs, 6); /* borrowed */
    if (digest == NULL) {
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "chain_packed() wants parent bytes and token bytes");
        return NULL;
    }
    first = PyLong_AsSsize_t(args[2]);
    block_size = PyLong_AsSsize_t(args[3]);
    num_blocks = PyLong_AsSsize_t(args[4]);
    cbor = PyObject_IsTrue(args[5]);
    if (PyErr_Occurred() || cbor < 0) {
        return NULL;
    }
    Py_ssize_t num_tokens = PyBytes_GET_SIZE(args[1]) / (Py_ssize_t)sizeof(uint32_t);
    if (first < 0 || block_size < 1 || num_blocks < 0 || first > num_tokens ||
        num_blocks > (num_tokens - first) / block_size) {
        PyErr_SetString(PyExc_ValueError, "chain_packed() wants its blocks inside token_bytes");
        return NULL;
    }
    if (block_size > MAX_BLOCK_SIZE || PyBytes_GET_SIZE(args[0]) > MAX_PARENT_SIZE) {
        Py_RETURN_NONE;
    }
    const char *packed = PyBytes_AS_STRING(args[1]) + first * (Py_ssize_t)sizeof(uint32_t);
    return chain_impl(args[0], NULL, packed, block_size, num_blocks, cbor, digest);
}

PyDoc_STRVAR(pack_ids_doc,
"pack_ids(tokens, /)\n--\n\n"
"The token ids (a list or tuple) packed as native uint32, as array('I', tokens).tobytes() packs them;\n"
"None unless every id is an exact int (bools refused) in [0, 2**32), so a result also proves the types.");

static PyObject *
pack_ids(PyObject *module, PyObject *seq)
{
    Py_ssize_t count;
    PyObject *const *items;
    PyObject *packed;
    uint32_t *out;
    Py_ssize_t i;

    (void)module;
    if (!(PyList_CheckExact(seq) || PyTuple_CheckExact(seq))) {
        PyErr_SetString(PyExc_TypeError, "pack_ids() wants a list or tuple");
        return NULL;
    }
    count = PySequence_Fast_GET_SIZE(seq);
    items = PySequence_Fast_ITEMS(seq);
    packed = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(uint32_t));
    if (packed == NULL) {
        return NULL;
    }
    out = (uint32_t *)PyBytes_AS_STRING(packed);
    for (i = 0; i < count; i++) {
        unsigned long value;
        long small;

        PREFETCH_ID(items, i, count);
        if (!PyLong_CheckExact(items[i])) {
            Py_DECREF(packed);
            Py_RETURN_NONE;
        }
        small = small_value(items[i]);
        value = small >= 0 ? (unsigned long)small : PyLong_AsUnsignedLong(items[i]);
        if ((value == (unsigned long)-1 && PyErr_Occurred()) || value > UINT32_MAX) {
            PyErr_Clear(); /* negative, or too large for the memo's keys */
            Py_DECREF(packed);
            Py_RETURN_NONE;
        }
        out[i] = (uint32_t)value;
    }
    return packed;
}

/* ---- the memo's segment tags: XXH64 (seed 0) of each token run ---- */

#define XXH_P1 0x9E3779B185EBCA87ULL
#define XXH_P2 0xC2B2AE3D27D4EB4FULL
#define XXH_P3 0x165667B19E3779F9ULL
#define XXH_P4 0x85EBCA77C2B2AE63ULL
#define XXH_P5 0x27D4EB2F165667C5ULL

static uint64_t
rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static uint64_t
read64le(const unsigned char *p)
{
    uint64_t v;

    memcpy(&v, p, sizeof v); /* one unaligned load; a byte loop is not always merged into one */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static uint64_t
xxh64_round(uint64_t acc, uint64_t input)
{
    return rotl64(acc + input * XXH_P2, 31) * XXH_P1;
}

static uint64_t
xxh64_merge(uint64_t acc, uint64_t lane)
{
    return (acc ^ xxh64_round(0, lane)) * XXH_P1 + XXH_P4;
}

static uint64_t
xxh64(const unsigned char *p, size_t len)
{
    const unsigned char *end = p + len;
    uint64_t h;

    if (len >= 32) {
        uint64_t v1 = XXH_P1 + XXH_P2, v2 = XXH_P2, v3 = 0, v4 = 0 - XXH_P1;
        for (; p + 32 <= end; p += 32) {
            v1 = xxh64_round(v1, read64le(p));
            v2 = xxh64_round(v2, read64le(p + 8));
            v3 = xxh64_round(v3, read64le(p + 16));
            v4 = xxh64_round(v4, read64le(p + 24));
        }
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xxh64_merge(xxh64_merge(xxh64_merge(xxh64_merge(h, v1), v2), v3), v4);
    }
    else {
        h = XXH_P5;
    }
    h += (uint64_t)len;
    for (; p + 8 <= end; p += 8) {
        h = rotl64(h ^ xxh64_round(0, read64le(p)), 27) * XXH_P1 + XXH_P4;
    }
    if (p + 4 <= end) {
        uint64_t word = (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24;
        h = rotl64(h ^ (word * XXH_P1), 23) * XXH_P2 + XXH_P3;
        p += 4;
    }
    for (; p < end; p++) {
        h = rotl64(h ^ (*p * XXH_P5), 11) * XXH_P1;
    }
    h ^= h >> 33;
    h *= XXH_P2;
    h ^= h >> 29;
    h *= XXH_P3;
    h ^= h >> 32;
    return h;
}

PyDoc_STRVAR(pack_ids_tagged_doc,
"pack_ids_tagged(tokens, seg_ids, /)\n--\n\n"
"(pack_ids(tokens), segment_tags of every full run of seg_ids ids in it) in one pass: each run's XXH64\n"
"is computed as its ids are packed, so the hashing overlaps the reads of the ids. seg_ids must be a\n"
"positive multiple of 8. None where pack_ids gives None.");

/* Each full run's tag is what xxh64() gives over its packed bytes (a multiple of 32 bytes: no tail), its
 * stripes folded in as they are written, so the hashing overlaps the reads of the int objects; the
 * separate segment_tags pass over the packed bytes was a sixth of a warm prompt's resolve. */
static PyObject *
pack_ids_tagged(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !(PyList_CheckExact(args[0]) || PyTuple_CheckExact(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "pack_ids_tagged() takes (list or tuple, seg_ids)");
        return NULL;
    }
    Py_ssize_t seg_ids = PyLong_AsSsize_t(args[1]);
    if (seg_ids == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (seg_ids < 8 || seg_ids % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "pack_ids_tagged() wants seg_ids a positive multiple of 8");
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(args[0]);
    PyObject *const *items = PySequence_Fast_ITEMS(args[0]);
    Py_ssize_t num_tags = count / seg_ids;
    PyObject *packed = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(uint32_t));
    PyObject *tags = PyList_New(num_tags);
    if (packed == NULL || tags == NULL) {
        Py_XDECREF(packed);
        Py_XDECREF(tags);
        return NULL;
    }
    uint32_t *out = (uint32_t *)PyBytes_AS_STRING(packed);
    Py_ssize_t i = 0;
    for (Py_ssize_t t = 0; t <= num_tags; t++) {
        /* a full run hashed as it is packed; then (t == num_tags) the ids past the last full run */
        Py_ssize_t stop = t < num_tags ? i + seg_ids : count;
        uint64_t v1 = XXH_P1 + XXH_P2, v2 = XXH_P2, v3 = 0, v4 = 0 - XXH_P1;
        for (; i < stop; i++) {
            PREFETCH_ID(items, i, count);
            if (!PyLong_CheckExact(items[i])) {
                goto refuse;
            }
            long small = small_value(items[i]);
            unsigned long value = small >= 0 ? (unsigned long)small : PyLong_AsUnsignedLong(items[i]);
            if ((value == (unsigned long)-1 && PyErr_Occurred()) || value > UINT32_MAX) {
                PyErr_Clear(); /* negative, or too large for the memo's keys */
                goto refuse;
            }
            out[i] = (uint32_t)value;
            if (t < num_tags && i % 8 == 7) { /* a 32-byte stripe is complete */
                const unsigned char *stripe = (const unsigned char *)(out + i - 7);
                v1 = xxh64_round(v1, read64le(stripe));
                v2 = xxh64_round(v2, read64le(stripe + 8));
                v3 = xxh64_round(v3, read64le(stripe + 16));
                v4 = xxh64_round(v4, read64le(stripe + 24));
            }
        }
        if (t < num_tags) {
            uint64_t h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
            h = xxh64_merge(xxh64_merge(xxh64_merge(xxh64_merge(h, v1), v2), v3), v4);
            h += (uint64_t)seg_ids * sizeof(uint32_t);
            h ^= h >> 33;
            h *= XXH_P2;
            h ^= h >> 29;
            h *= XXH_P3;
            h ^= h >> 32;
            PyObject *tag = PyLong_FromUnsignedLongLong(h);
            if (tag == NULL) {
                Py_DECREF(packed);
                Py_DECREF(tags);
                return NULL;
            }
            PyList_SET_ITEM(tags, t, tag);
        }
    }
    return Py_BuildValue("(NN)", packed, tags);
refuse:
    Py_DECREF(packed);
    Py_DECREF(tags);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(segment_tags_doc,
"segment_tags(data, start, width, count, /)\n--\n\n"
"XXH64 (seed 0) of each of count consecutive runs of width bytes of data from offset start, as ints:\n"
"the memo's segment tags in one call instead of one slice and one call per segment.");

static PyObject *
segment_tags(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    const unsigned char *data;
    Py_ssize_t numbers[3]; /* start, width, count */
    Py_ssize_t width;
    Py_ssize_t count;
    PyObject *tags;
    Py_ssize_t i;

    (void)module;
    if (nargs != 4 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "segment_tags() takes (bytes, start, width, count)");
        return NULL;
    }
    for (i = 0; i < 3; i++) {
        numbers[i] = PyLong_AsSsize_t(args[i + 1]);
        if (numbers[i] == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    width = numbers[1];
    count = numbers[2];
    if (numbers[0] < 0 || numbers[0] > PyBytes_GET_SIZE(args[0]) || width < 1 || count < 0
        || count > (PyBytes_GET_SIZE(args[0]) - numbers[0]) / width) {
        PyErr_SetString(PyExc_ValueError, "segment_tags() wants its runs inside data");
        return NULL;
    }
    data = (const unsigned char *)PyBytes_AS_STRING(args[0]) + numbers[0];
    tags = PyList_New(count);
    if (tags == NULL) {
        return NULL;
    }
    for (i = 0; i < count; i++) {
        PyObject *tag = PyLong_FromUnsignedLongLong(xxh64(data + i * width, (size_t)width));
        if (tag == NULL) {
            Py_DECREF(tags);
            return NULL;
        }
        PyList_SET_ITEM(tags, i, tag);
    }
    return tags;
}

PyDoc_STRVAR(walk_segments_doc,
"walk_segments(segments, parent, tags, token_bytes, seg_width, seg_blocks, digests, low_checks, /)\n--\n\n"
"DigestMemo.resolve's walk over the full segments of a prompt without extra keys, as its Python loop\n"
"does it: while segments (an OrderedDict) holds (parent, tag, None) whose run starts token_bytes at the\n"
"segment's offset, refresh it, extend digests with its digests, append (first, stop, key or None) to\n"
"low_checks (None: no checks wanted) unless its has_low is False, and go on from its last digest.\n"
"Returns (blocks walked, parent).");

static PyObject *str_move_to_end;

static PyObject *
walk_segments(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 8 || !PyDict_Check(args[0]) || !PyList_CheckExact(args[2]) || !PyBytes_Check(args[3])
        || !PyList_CheckExact(args[6]) || !(PyList_CheckExact(args[7]) || args[7] == Py_None)) {
        PyErr_SetString(PyExc_TypeError,
                        "walk_segments() takes (OrderedDict, bytes, list, bytes, int, int, list, list or None)");
        return NULL;
    }
    PyObject *segments = args[0], *tags = args[2], *digests = args[6], *low_checks = args[7];
    Py_ssize_t seg_width = PyLong_AsSsize_t(args[4]);
    Py_ssize_t seg_blocks = PyLong_AsSsize_t(args[5]);
    if ((seg_width == -1 || seg_blocks == -1) && PyErr_Occurred()) {
        return NULL;
    }
    const char *data = PyBytes_AS_STRING(args[3]);
    Py_ssize_t data_len = PyBytes_GET_SIZE(args[3]);
    PyObject *parent = Py_NewRef(args[1]);
    Py_ssize_t index = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tags); i++) {
        PyObject *key = PyTuple_Pack(3, parent, PyList_GET_ITEM(tags, i), Py_None);
        if (key == NULL) {
            goto fail;
        }
        PyObject *found = PyDict_GetItemWithError(segments, key); /* borrowed */
        if (found == NULL) {
            Py_DECREF(key);
            if (PyErr_Occurred()) {
                goto fail;
            }
            break;
        }
        if (!PyTuple_CheckExact(found) || PyTuple_GET_SIZE(found) != 3 || !PyBytes_Check(PyTuple_GET_ITEM(found, 0))
            || !PyTuple_CheckExact(PyTuple_GET_ITEM(found, 1)) || PyTuple_GET_SIZE(PyTuple_GET_ITEM(found, 1)) == 0) {
            Py_DECREF(key);
            PyErr_SetString(PyExc_TypeError, "a memo segment is (run, digests, has_low)");
            goto fail;
        }
        PyObject *run = PyTuple_GET_ITEM(found, 0);
        Py_ssize_t offset = i * seg_width;
        Py_ssize_t run_len = PyBytes_GET_SIZE(run);
        /* token_bytes.startswith(run, offset) */
        if (offset > data_len || run_len > data_len - offset || memcmp(data + offset, PyBytes_AS_STRING(run), (size_t)run_len) != 0) {
            Py_DECREF(key);
            break;
        }
        Py_INCREF(found); /* moving the key keeps its value, but hold it across the call anyway */
        PyObject *moved = PyObject_CallMethodOneArg(segments, str_move_to_end, key);
        if (moved == NULL) {
            Py_DECREF(found);
            Py_DECREF(key);
            goto fail;
        }
        Py_DECREF(moved);
        PyObject *seg_digests = PyTuple_GET_ITEM(found, 1);
        PyObject *has_low = PyTuple_GET_ITEM(found, 2);
        Py_ssize_t size = PyList_GET_SIZE(digests);
        int failed = PyList_SetSlice(digests, size, size, seg_digests) < 0;
        if (!failed && has_low != Py_False && low_checks != Py_None) {
            PyObject *check = Py_BuildValue("(nnO)", index, index + seg_blocks, has_low == Py_None ? key : Py_None);
            failed = check == NULL || PyList_Append(low_checks, check) < 0;
            Py_XDECREF(check);
        }
        if (!failed) {
            Py_SETREF(parent, Py_NewRef(PyTuple_GET_ITEM(seg_digests, PyTuple_GET_SIZE(seg_digests) - 1)));
        }
        Py_DECREF(found);
        Py_DECREF(key);
        if (failed) {
            goto fail;
        }
        index += seg_blocks;
    }
    return Py_BuildValue("(nN)", index, parent);
fail:
    Py_DECREF(parent);
    return NULL;
}

PyDoc_STRVAR(event_keys_doc,
"event_keys(digests, /)\n--\n\n"
"The event key of each digest in the list (its last 8 bytes, big-endian), packed as native uint64 (as\n"
"array('Q', keys).tobytes() packs them): what a lookup reads, without an int object per block.");

static PyObject *
event_keys(PyObject *module, PyObject *digests)
{
    (void)module;
    if (!PyList_CheckExact(digests)) {
        PyErr_SetString(PyExc_TypeError, "event_keys() wants a list of digests");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(digests);
    PyObject *packed = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(uint64_t));
    if (packed == NULL) {
        return NULL;
    }
    char *out = PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *digest = PyList_GET_ITEM(digests, i);
        if (!PyBytes_Check(digest) || PyBytes_GET_SIZE(digest) < 8) {
            Py_DECREF(packed);
            PyErr_SetString(PyExc_TypeError, "event_keys() wants digests of 8 bytes or more");
            return NULL;
        }
        const unsigned char *tail = (const unsigned char *)PyBytes_AS_STRING(digest) + PyBytes_GET_SIZE(digest) - 8;
        uint64_t key = 0;
        for (int k = 0; k < 8; k++) {
            key = key << 8 | tail[k];
        }
        memcpy(out + i * (Py_ssize_t)sizeof(uint64_t), &key, sizeof key);
    }
    return packed;
}

PyDoc_STRVAR(preimage_doc,
"preimage(parent, tokens, cbor, /)\n--\n\n"
"The bytes chain() hashes for one block (parent, tuple(tokens), None): pickle protocol 5, or canonical\n"
"CBOR if cbor is true. For tests, which compare them with pickle.dumps and cbor2.dumps. None where\n"
"chain() would return None.");

static PyObject *
preimage(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t block_size;
    uint64_t *tokens;
    unsigned char *buf;
    PyObject *result = NULL;
    int cbor;

    (void)module;
    if (nargs != 3 || !PyBytes_Check(args[0]) || !(PyList_CheckExact(args[1]) || PyTuple_CheckExact(args[1]))) {
        PyErr_SetString(PyExc_TypeError, "preimage() takes (bytes, list or tuple, cbor)");
        return NULL;
    }
    cbor = PyObject_IsTrue(args[2]);
    if (cbor < 0) {
        return NULL;
    }
    block_size = PySequence_Fast_GET_SIZE(args[1]);
    if (block_size < 1 || block_size > MAX_BLOCK_SIZE || PyBytes_GET_SIZE(args[0]) > MAX_PARENT_SIZE) {
        Py_RETURN_NONE;
    }
    tokens = PyMem_Malloc((size_t)block_size * sizeof(uint64_t));
    buf = PyMem_Malloc(PREIMAGE_OVERHEAD + 11 * (size_t)block_size);
    if (tokens == NULL || buf == NULL) {
        PyErr_NoMemory();
    }
    else if (read_tokens(PySequence_Fast_ITEMS(args[1]), block_size, tokens)) {
        result = Py_NewRef(Py_None);
    }
    else {
        const unsigned char *parent = (const unsigned char *)PyBytes_AS_STRING(args[0]);
        size_t parent_size = (size_t)PyBytes_GET_SIZE(args[0]);
        size_t size = cbor ? cbor_preimage(buf, parent, parent_size, tokens, block_size)
                           : pickle_preimage(buf, parent, parent_size, tokens, block_size);
        result = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)size);
    }
    PyMem_Free(tokens);
    PyMem_Free(buf);
    return result;
}

/* untrack_atomic(objects): the cyclic collector stops tracking each tuple of the list `objects` whose items
 * it does not track (bytes, ints, None, bools, tuples already untracked: earlier items count). It is what
 * CPython's collector does to such a tuple at the first collection it survives; a memo entry survives,
 * and a cold 8192-token prompt records 96 such tuples, so every ~7 prompts a young-generation collection
 * scanned ~1,000 of them and their ~7,500 items (0.2 ms) before untracking them. */
static PyObject *
untrack_atomic(PyObject *module, PyObject *objects)
{
    Py_ssize_t i;
    Py_ssize_t j;

    (void)module;
    if (!PyList_CheckExact(objects)) {
        PyErr_SetString(PyExc_TypeError, "untrack_atomic() takes a list");
        return NULL;
    }
    for (i = 0; i < PyList_GET_SIZE(objects); i++) {
        PyObject *item = PyList_GET_ITEM(objects, i);
        int atomic = 1;

        if (!PyTuple_CheckExact(item) || !PyObject_GC_IsTracked(item)) {
            continue;
        }
        for (j = 0; j < PyTuple_GET_SIZE(item); j++) {
            PyObject *element = PyTuple_GET_ITEM(item, j);
            if (PyObject_IS_GC(element) && PyObject_GC_IsTracked(element)) {
                atomic = 0;
                break;
            }
        }
        if (atomic) {
            PyObject_GC_UnTrack(item);
        }
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(untrack_atomic_doc,
             "untrack_atomic(objects, /)\n--\n\n"
             "Stop the cyclic GC tracking every tuple in the list that holds only untracked objects.");

static PyMethodDef chain_methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, chain_doc},
    {"chain_packed", (PyCFunction)(void (*)(void))chain_packed, METH_FASTCALL, chain_packed_doc},
    {"pack_ids", pack_ids, METH_O, pack_ids_doc},
    {"event_keys", event_keys, METH_O, event_keys_doc},
    {"pack_ids_tagged", (PyCFunction)(void (*)(void))pack_ids_tagged, METH_FASTCALL, pack_ids_tagged_doc},
    {"segment_tags", (PyCFunction)(void (*)(void))segment_tags, METH_FASTCALL, segment_tags_doc},
    {"preimage", (PyCFunction)(void (*)(void))preimage, METH_FASTCALL, preimage_doc},
    {"untrack_atomic", untrack_atomic, METH_O, untrack_atomic_doc},
    {"walk_segments", (PyCFunction)(void (*)(void))walk_segments, METH_FASTCALL, walk_segments_doc},
    {NULL, NULL, 0, NULL},
};

static void
chain_free(void *module)
{
    (void)module;
    EVP_MD_free(sha256_md);
    sha256_md = NULL;
}

static struct PyModuleDef chain_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvindex.hashing._chain",
    .m_doc = "The compiled core of vLLM's sha256 / sha256_cbor block-hash chain (see hashing/compiled.py).",
    .m_size = -1,
    .m_methods = chain_methods,
    .m_free = chain_free,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    /* Fetched once: a per-call lookup by name costs about as much as hashing a block. */
    if (sha256_md == NULL) {
        sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
        if (sha256_md == NULL) {
            PyErr_SetString(PyExc_ImportError, "OpenSSL has no SHA256 digest");
            return NULL;
        }
    }
    if (str_move_to_end == NULL) {
        str_move_to_end = PyUnicode_InternFromString("move_to_end");
        if (str_move_to_end == NULL) {
            return NULL;
        }
    }
    return PyModule_Create(&chain_module);
}
