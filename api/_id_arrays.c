/* kvindex.api._id_arrays: a score request's `token_ids` or `block_hashes` read straight from its JSON body
 * into native integers: token ids as uint32, the form the hasher's memo keys on (array('I', ids).tobytes()),
 * block hashes as uint64, the form the index's lookup reads in place (array('Q', keys).tobytes()).
 *
 * Decoding 8,192 ids into a list of PyLongs was the largest server-side cost of a token request (~165 us
 * with msgspec, then ~15 us to pack them again for the memo); 512 block hashes cost ~25 us to decode and
 * ~6 us to range-check. Here one pass over the body finds the top-level key and reads its digits into the
 * packed form, with no Python object per id; the caller has msgspec decode the rest of the body with the
 * array's bytes replaced by `null`. A token array with no whitespace (what most JSON writers emit), or with
 * ", " between ids (Python's json.dumps), is read in 64-byte stripes on x86-64 (parse_dense_u32): 8,192
 * ids of a 150k vocabulary in ~27 us (~28 us spaced), not ~47 us.
 *
 * Only the plain shape is read: an object with exactly one top-level "token_ids" or "block_hashes" key
 * (not both, and no top-level key with an escape, which could spell either another way), whose value is
 * `[`, ints in range (token ids below 2**32, block hashes below 2**64) written as JSON writes them (no
 * sign, fraction, exponent or leading zero), separated by commas, `]`, with JSON whitespace anywhere
 * between. Anything else returns None and the caller decodes the whole body with msgspec, which accepts
 * or refuses it with its exact message: this reader never judges a request, it only declines it. Of the
 * other values only the extent is found here; msgspec checks them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h> /* part of every x86-64 target: no runtime dispatch needed */
#endif

static inline int
is_ws(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static const unsigned char *
skip_ws(const unsigned char *p, const unsigned char *end)
{
    while (p < end && is_ws(*p)) {
        p++;
    }
    return p;
}

/* The 8 bytes at p as one little-endian word (the first byte lowest). */
static inline uint64_t
load8(const unsigned char *p)
{
    uint64_t chunk;

    memcpy(&chunk, p, sizeof chunk);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    chunk = __builtin_bswap64(chunk);
#endif
    return chunk;
}

/* A byte's top bit: below '0' (c - 0x30 borrows) or above '9' (c + 0x46 reaches 0x80). Borrows and carries
 * only run upwards, so the lowest flagged byte is the first non-digit. */
static inline uint64_t
non_digits(uint64_t chunk)
{
    return ((chunk - 0x3030303030303030ULL) | (chunk + 0x4646464646464646ULL)) & 0x8080808080808080ULL;
}

/* The value of the first `width` (1 to 8) bytes of `chunk`, all digits. They are moved to the top bytes
 * (the first digit, the most significant, lowest; zero bytes below it read as leading zeros), then combined
 * pairwise, 8 one-digit lanes -> 4 of two digits -> 2 of four -> 1, each step one mask, one multiply that
 * adds a lane's neighbour to ten (100, 10000) times the lane, and one shift (the digit mask, 0x0F, also
 * drops the '0'). Against a multiply-add-shift-mask per step: 8,192 ids from 29.3 to 27.9 us, below 2**32
 * from 45.5 to 41.7 us. */
static inline uint64_t
digits_value(uint64_t chunk, int width)
{
    uint64_t d = (chunk & (~0ULL >> (64 - 8 * width))) << (64 - 8 * width);

    d = ((d & 0x0F0F0F0F0F0F0F0FULL) * (1 + (10 << 8))) >> 8;
    d = ((d & 0x00FF00FF00FF00FFULL) * (1 + (100 << 16))) >> 16;
    return ((d & 0x0000FFFF0000FFFFULL) * (1 + (10000ULL << 32))) >> 32;
}

static const uint64_t POWERS_OF_TEN[9] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000};

/* The id (below 2**64) whose digits start at p, as *value; returns the byte after its digits, or NULL for
 * no digit, a leading zero or an id of 2**64 or more. Up to 16 digits are read 8 at a time (a token id, at
 * most 10 digits, mostly in one step), the rest one at a time with overflow checks (a block hash's 19 or
 * 20). */
static inline const unsigned char *
read_id(const unsigned char *p, const unsigned char *end, uint64_t *value)
{
    const unsigned char *digits = p;
    uint64_t total = 0;

    while (end - p >= 8 && p - digits < 16) {
        uint64_t chunk = load8(p);
        uint64_t non_digit = non_digits(chunk);

        if (non_digit != 0) { /* the run ends in these 8 bytes: at most 15 digits, no overflow */
            int width = __builtin_ctzll(non_digit) >> 3;

            if (width > 0) {
                total = total * POWERS_OF_TEN[width] + digits_value(chunk, width);
                p += width;
            }
            goto done;
        }
        total = total * 100000000 + digits_value(chunk, 8);
        p += 8;
    }
    while ((unsigned)(*p - '0') < 10u) { /* the input's NUL terminator stops this too */
        if (__builtin_mul_overflow(total, 10, &total) || __builtin_add_overflow(total, (uint64_t)(*p - '0'), &total)) {
            return NULL;
        }
        p++;
    }
done:
    if (p == digits || (*digits == '0' && p - digits > 1) || p > end) {
        return NULL;
    }
    *value = total;
    return p;
}

#if defined(__SSE2__)
/* The common token array, digits and single commas only up to its `]` (what msgspec, orjson, serde_json,
 * Go and JavaScript write), or digits and ", " (what Python's json.dumps writes by default, and with it
 * most Python clients): the first separator says which, and every other must be the same. It is read in
 * 64-byte stripes: one pass checks every byte and finds the commas, and each id is then read from its
 * known width, independently of the others. read_id's byte-by-byte run ends chain every id's read to the
 * one before it (~6.5 ns per id); here they overlap. `p` is the first byte after `[`. Returns the byte
 * after `]`, or NULL when the array is not in this form, whatever the reason: the caller then reads it
 * from the start with parse_array's general loop, which alone decides what is read or declined; this path
 * only ever reads a subset of what that loop reads, to the same ids. */
static const unsigned char *
parse_dense_u32(const unsigned char *p, const unsigned char *end, uint32_t *out, Py_ssize_t *count)
{
    const unsigned char *close = memchr(p, ']', (size_t)(end - p));
    const __m128i zero_digit = _mm_set1_epi8('0');
    const __m128i nine = _mm_set1_epi8(9);
    const __m128i comma = _mm_set1_epi8(',');
    const __m128i space = _mm_set1_epi8(' ');
    const unsigned char *id_start = p;
    const unsigned char *q = p;
    const unsigned char *first_comma;
    Py_ssize_t n = 0;
    /* 1 when ids are separated by ", " (each comma followed by exactly one space), 0 for "," alone. */
    int spaced;
    /* A space owed at the next stripe's first byte: the stripe before ended in a comma. */
    uint64_t owed = 0;

    if (close == NULL || close == p) {
        return NULL;
    }
    first_comma = memchr(p, ',', (size_t)(close - p));
    spaced = first_comma != NULL && first_comma[1] == ' ';
    while (q < close) {
        /* The commas of the next 64 bytes as one mask: a mask per 16 bytes (two or three ids) made the
         * loop below end at a different count each time, a mispredicted branch per stripe. */
        uint64_t commas = 0;
        uint64_t spaces = 0;
        uint64_t expected;
        Py_ssize_t span = close - q >= 64 ? 64 : close - q;

        if (span == 64) {
            for (int part = 0; part < 4; part++) {
                __m128i chunk = _mm_loadu_si128((const __m128i *)(q + 16 * part));
                __m128i value = _mm_sub_epi8(chunk, zero_digit);
                __m128i is_digit = _mm_cmpeq_epi8(_mm_min_epu8(value, nine), value);
                __m128i is_comma = _mm_cmpeq_epi8(chunk, comma);
                __m128i is_space = _mm_cmpeq_epi8(chunk, space);

                if (_mm_movemask_epi8(_mm_or_si128(_mm_or_si128(is_digit, is_comma), is_space)) != 0xFFFF) {
                    return NULL;
                }
                commas |= (uint64_t)(unsigned int)_mm_movemask_epi8(is_comma) << (16 * part);
                spaces |= (uint64_t)(unsigned int)_mm_movemask_epi8(is_space) << (16 * part);
            }
        } else { /* the last few bytes, one at a time */
            for (Py_ssize_t i = 0; i < span; i++) {
                if (q[i] == ',') {
                    commas |= 1ULL << i;
                } else if (q[i] == ' ') {
                    spaces |= 1ULL << i;
                } else if ((unsigned)(q[i] - '0') >= 10u) {
                    return NULL;
                }
            }
        }
        /* Spaces exactly where the separator puts them: after every comma (the last stripe's last comma
         * included), and nowhere else. A comma owing its space to `]` leaves the last id empty, below. */
        expected = spaced ? (commas << 1) | owed : 0;
        if (span < 64) {
            expected &= (1ULL << span) - 1;
        }
        if (spaces != expected) {
            return NULL;
        }
        owed = spaced && span == 64 ? commas >> 63 : 0;
        /* Each comma ends the id begun after the one before; the last id ends at `close`, below. */
        while (commas != 0) {
            const unsigned char *id_end = q + __builtin_ctzll(commas);
            Py_ssize_t width = id_end - id_start;
            uint64_t value;

            commas &= commas - 1;
            if (width <= 0 || width > 10 || (*id_start == '0' && width > 1)) {
                return NULL;
            }
            if (width > 8) { /* 9 or 10 digits: two overlapping words, both inside the id */
                value = digits_value(load8(id_start), (int)width - 8) * 100000000
                    + digits_value(load8(id_end - 8), 8);
                if (value > UINT32_MAX) {
                    return NULL;
                }
            } else if (end - id_start >= 8) {
                value = digits_value(load8(id_start), (int)width);
            } else {
                return NULL; /* too near the body's end for a word: the general loop reads it */
            }
            out[n++] = (uint32_t)value;
            id_start = id_end + 1 + spaced;
        }
        q += span;
    }
    {
        Py_ssize_t width = close - id_start;
        uint64_t value = 0;

        if (width <= 0 || width > 10 || (*id_start == '0' && width > 1)) {
            return NULL;
        }
        for (const unsigned char *d = id_start; d < close; d++) { /* once per array: no word needed */
            value = value * 10 + (uint64_t)(*d - '0');
        }
        if (value > UINT32_MAX) {
            return NULL;
        }
        out[n++] = (uint32_t)value;
    }
    *count = n;
    return close + 1;
}
#endif

/* A plain array at p (no leading whitespace): its ids written to out (uint64 if `wide`, else uint32; room
 * for one id per two bytes of the input), *count set; returns the byte after its `]`, or NULL if it is not
 * a plain array. The input must be followed by a NUL byte (a bytes object's terminator), which stops every
 * digit and space run. Inlined with a constant `wide`, so each width gets its own loop. */
static inline const unsigned char *
parse_array(const unsigned char *p, const unsigned char *end, void *out, int wide, Py_ssize_t *count)
{
    Py_ssize_t n = 0;

    if (p == end || *p++ != '[') {
        return NULL;
    }
    p = skip_ws(p, end);
    if (p < end && *p == ']') {
        *count = 0;
        return p + 1;
    }
#if defined(__SSE2__)
    if (!wide) {
        const unsigned char *after = parse_dense_u32(p, end, (uint32_t *)out, count);

        if (after != NULL) {
            return after;
        }
    }
#endif
    for (;;) {
        uint64_t value;

        p = read_id(p, end, &value);
        if (p == NULL || (!wide && value > UINT32_MAX)) {
            return NULL; /* no digit, a leading zero (not JSON), or out of range */
        }
        if (wide) {
            ((uint64_t *)out)[n++] = value;
        } else {
            ((uint32_t *)out)[n++] = (uint32_t)value;
        }
        if (*p == ',') { /* the common case: no space after an id */
            p++;
        } else {
            p = skip_ws(p, end);
            if (p == end) {
                return NULL;
            }
            if (*p == ']') {
                *count = n;
                return p + 1;
            }
            if (*p != ',') {
                return NULL; /* a fraction, an exponent, or anything but a separator */
            }
            p++;
        }
        if (is_ws(*p)) {
            p = skip_ws(p, end);
        }
    }
}

/* The byte after the JSON string starting at p (its opening quote); NULL if it does not end. */
static const unsigned char *
skip_string(const unsigned char *p, const unsigned char *end)
{
    for (p++; p < end; p++) {
        if (*p == '"') {
            return p + 1;
        }
        if (*p == '\\') {
            p++; /* the escaped character, whatever it is: only the string's end matters here */
        }
    }
    return NULL;
}

/* The byte after the JSON value starting at p. Only its extent is found (strings, and brackets outside
 * strings): whether it is well formed is left to msgspec, which decodes everything but token_ids. */
static const unsigned char *
skip_value(const unsigned char *p, const unsigned char *end)
{
    Py_ssize_t depth = 0;

    if (p == end) {
        return NULL;
    }
    if (*p == '"') {
        return skip_string(p, end);
    }
    if (*p != '[' && *p != '{') {
        while (p < end && !is_ws(*p) && *p != ',' && *p != '}' && *p != ']') {
            p++;
        }
        return p;
    }
    while (p < end) {
        unsigned char c = *p;

        if (c == '"') {
            p = skip_string(p, end);
            if (p == NULL) {
                return NULL;
            }
            continue;
        }
        if (c == '[' || c == '{') {
            depth++;
        } else if (c == ']' || c == '}') {
            if (--depth == 0) {
                return p + 1;
            }
        }
        p++;
    }
    return NULL;
}

/* The two keys this reader reads, by index: their names, and whether their ids are 64-bit. */
static const char *const KEYS[2] = {"token_ids", "block_hashes"};
static const int WIDE[2] = {0, 1};

/* Which of KEYS the key [key, key_end) is, or -1. */
static int
key_index(const unsigned char *key, const unsigned char *key_end)
{
    size_t len = (size_t)(key_end - key);

    for (int i = 0; i < 2; i++) {
        if (len == strlen(KEYS[i]) && memcmp(key, KEYS[i], len) == 0) {
            return i;
        }
    }
    return -1;
}

/* In the JSON object [p, end): the span of the value of its one top-level token_ids or block_hashes key,
 * which must be a plain array (ids to out, *count set). Returns the key's index in KEYS if found; -1 if the
 * body is not that shape: not an object, a top-level key with an escape (it could spell either), neither
 * key, both or one twice, or one that is not plain. */
static int
find_ids(const unsigned char *body, const unsigned char *end, void *out, Py_ssize_t *count,
         Py_ssize_t *start, Py_ssize_t *stop)
{
    const unsigned char *p = skip_ws(body, end);
    int found = -1;

    if (p == end || *p++ != '{') {
        return -1;
    }
    p = skip_ws(p, end);
    if (p < end && *p == '}') {
        return -1;
    }
    for (;;) {
        const unsigned char *key;
        const unsigned char *key_end;
        int which;

        if (p == end || *p != '"') {
            return -1;
        }
        key = p + 1;
        key_end = skip_string(p, end);
        if (key_end == NULL || memchr(key, '\\', (size_t)(key_end - 1 - key)) != NULL) {
            return -1;
        }
        which = key_index(key, key_end - 1);
        p = skip_ws(key_end, end);
        if (p == end || *p++ != ':') {
            return -1;
        }
        p = skip_ws(p, end);
        if (which >= 0) {
            const unsigned char *after;

            if (found >= 0) {
                return -1; /* a duplicate, or both: msgspec and the validation answer those */
            }
            after = WIDE[which] ? parse_array(p, end, out, 1, count) : parse_array(p, end, out, 0, count);
            if (after == NULL) {
                return -1;
            }
            found = which;
            *start = p - body;
            *stop = after - body;
            p = after;
        } else {
            p = skip_value(p, end);
            if (p == NULL) {
                return -1;
            }
        }
        p = skip_ws(p, end);
        if (p == end) {
            return -1;
        }
        if (*p == ',') {
            p = skip_ws(p + 1, end);
            continue;
        }
        if (*p == '}') {
            break;
        }
        return -1;
    }
    return skip_ws(p + 1, end) == end ? found : -1;
}

PyDoc_STRVAR(find_ids_doc,
"find_ids(body, /)\n--\n\n"
"In a score request's JSON body (bytes): (key, packed, start, stop) where key is 'token_ids' or\n"
"'block_hashes', packed the array's ids as native uint32 or uint64, and [start, stop) the array's bytes;\n"
"None unless the body is an object with exactly one of those keys, once, a plain array of ints in range\n"
"(below 2**32, 2**64), and no top-level key with an escape.");

static PyObject *
find_ids_py(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    uint64_t *ids;
    Py_ssize_t count = 0;
    Py_ssize_t start = 0;
    Py_ssize_t stop = 0;
    PyObject *result;
    int which;

    (void)module;
    if (!PyBytes_Check(arg)) { /* parse_array relies on the NUL byte after a bytes object's data */
        PyErr_SetString(PyExc_TypeError, "find_ids() wants bytes");
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    /* One id per two bytes of input is always enough room: each id takes a digit and a separator. */
    ids = PyMem_Malloc((size_t)(view.len / 2 + 1) * sizeof(uint64_t));
    if (ids == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    which = find_ids((const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len, ids, &count,
                     &start, &stop);
    if (which >= 0) {
        Py_ssize_t size = WIDE[which] ? (Py_ssize_t)sizeof(uint64_t) : (Py_ssize_t)sizeof(uint32_t);

        result = Py_BuildValue("(sy#nn)", KEYS[which], (const char *)ids, count * size, start, stop);
    } else {
        result = Py_NewRef(Py_None);
    }
    PyMem_Free(ids);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef id_arrays_methods[] = {
    {"find_ids", find_ids_py, METH_O, find_ids_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef id_arrays_module = {
    PyModuleDef_HEAD_INIT,
    "kvindex.api._id_arrays",
    "A score request's token_ids or block_hashes read straight into packed native integers.",
    0,
    id_arrays_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__id_arrays(void)
{
    return PyModule_Create(&id_arrays_module);
}
