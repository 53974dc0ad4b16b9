/* kvindex.api._token_ids: a score request's `token_ids` read straight from its JSON body into native
 * uint32, the form the hasher's memo keys on (array('I', ids).tobytes()).
 *
 * Decoding 8,192 ids into a list of PyLongs was the largest server-side cost of a token request (~165 us
 * with msgspec, then ~15 us to pack them again for the memo). Here one pass over the body finds the
 * top-level "token_ids" key and reads its digits into the packed form, with no Python object per id; the
 * caller has msgspec decode the rest of the body with the array's bytes replaced by `null`.
 *
 * Only the plain shape is read: an object with exactly one top-level "token_ids" key (no top-level key
 * with an escape, which could spell it another way), whose value is `[`, ints in [0, 2**32) written as
 * JSON writes them (no sign, fraction, exponent or leading zero), separated by commas, `]`, with JSON
 * whitespace anywhere between. Anything else returns None and the caller decodes the whole body with
 * msgspec, which accepts or refuses it with its exact message: this reader never judges a request, it
 * only declines it. Of the other values only the extent is found here; msgspec checks them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

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

/* The run of fewer than 8 digits starting at p (8 readable bytes), as *value; returns its length, 8 if
 * the 8 bytes are all digits (value then unset). Branch-free: a branch on each id's length was
 * mispredicted about once per id, most of this reader's time. */
static inline int
short_run(const unsigned char *p, uint64_t *value)
{
    uint64_t chunk;
    uint64_t non_digit;
    uint64_t d;
    int width;

    memcpy(&chunk, p, sizeof chunk);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    chunk = __builtin_bswap64(chunk);
#endif
    /* A byte's top bit: below '0' (c - 0x30 borrows) or above '9' (c + 0x46 reaches 0x80). Borrows and
     * carries only run upwards, so the lowest flagged byte is the first non-digit. */
    non_digit = ((chunk - 0x3030303030303030ULL) | (chunk + 0x4646464646464646ULL)) & 0x8080808080808080ULL;
    if (non_digit == 0) {
        return 8;
    }
    width = __builtin_ctzll(non_digit) >> 3;
    if (width == 0) {
        *value = 0;
        return 0;
    }
    /* The digits' values, moved to the top bytes (the first digit, the most significant, lowest), then
     * combined pairwise: 8 one-digit lanes -> 4 of two digits -> 2 of four -> 1. */
    d = ((chunk - 0x3030303030303030ULL) & (~0ULL >> (64 - 8 * width))) << (64 - 8 * width);
    d = (d * 10 + (d >> 8)) & 0x00FF00FF00FF00FFULL;
    d = (d * 100 + (d >> 16)) & 0x0000FFFF0000FFFFULL;
    d = (d * 10000 + (d >> 32)) & 0x00000000FFFFFFFFULL;
    *value = d;
    return width;
}

/* A plain array at p (no leading whitespace): its ids written to out (room for one id per two bytes of
 * the input), *count set; returns the byte after its `]`, or NULL if it is not a plain array. The input
 * must be followed by a NUL byte (a bytes object's terminator), which stops every digit and space run. */
static const unsigned char *
parse_array(const unsigned char *p, const unsigned char *end, uint32_t *out, Py_ssize_t *count)
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
    for (;;) {
        const unsigned char *digits = p;
        uint64_t value = 0;
        int width = 8;

        if (end - p >= 8) {
            width = short_run(p, &value);
            p += width;
        }
        if (width == 8) { /* near the end, or 8 digits or more: one at a time */
            p = digits;
            value = 0;
            while ((unsigned)(*p - '0') < 10u) {
                p++;
            }
            if (p - digits > 10) {
                return NULL; /* too many for 32 bits */
            }
            for (const unsigned char *d = digits; d < p; d++) {
                value = value * 10 + (uint64_t)(*d - '0');
            }
        }
        if (p == digits || (*digits == '0' && p - digits > 1) || p > end || value > UINT32_MAX) {
            return NULL; /* no digit, a leading zero (not JSON), or out of range */
        }
        out[n++] = (uint32_t)value;
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

#define KEY "token_ids"
#define KEY_LEN (sizeof(KEY) - 1)

/* In the JSON object [p, end): the span of the value of its one top-level "token_ids" key, which must be
 * a plain array (ids to out, *count set). 0 if found; -1 if the body is not that shape: not an object, a
 * top-level key with an escape (it could spell token_ids), no token_ids or two, or one that is not plain. */
static int
find_ids(const unsigned char *body, const unsigned char *end, uint32_t *out, Py_ssize_t *count,
         Py_ssize_t *start, Py_ssize_t *stop)
{
    const unsigned char *p = skip_ws(body, end);
    int found = 0;

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
        int is_ids;

        if (p == end || *p != '"') {
            return -1;
        }
        key = p + 1;
        key_end = skip_string(p, end);
        if (key_end == NULL || memchr(key, '\\', (size_t)(key_end - 1 - key)) != NULL) {
            return -1;
        }
        is_ids = (size_t)(key_end - 1 - key) == KEY_LEN && memcmp(key, KEY, KEY_LEN) == 0;
        p = skip_ws(key_end, end);
        if (p == end || *p++ != ':') {
            return -1;
        }
        p = skip_ws(p, end);
        if (is_ids) {
            const unsigned char *after;

            if (found) {
                return -1; /* a duplicate: which one counts is msgspec's business */
            }
            after = parse_array(p, end, out, count);
            if (after == NULL) {
                return -1;
            }
            found = 1;
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
    return found && skip_ws(p + 1, end) == end ? 0 : -1;
}

/* One uint32 per two input bytes is always enough: each id takes a digit and a separator. */
static uint32_t *
id_room(Py_ssize_t len)
{
    uint32_t *ids = PyMem_Malloc((size_t)(len / 2 + 1) * sizeof(uint32_t));

    if (ids == NULL) {
        PyErr_NoMemory();
    }
    return ids;
}

static PyObject *
packed_bytes(const uint32_t *ids, Py_ssize_t count)
{
    return PyBytes_FromStringAndSize((const char *)ids, count * (Py_ssize_t)sizeof(uint32_t));
}

PyDoc_STRVAR(find_token_ids_doc,
"find_token_ids(body, /)\n--\n\n"
"In a score request's JSON body (bytes): (the top-level token_ids packed as native\n"
"uint32, start, stop), [start, stop) being the array's bytes; None unless the body is an object with\n"
"exactly one token_ids key, a plain array of ints in [0, 2**32), and no top-level key with an escape.");

static PyObject *
find_token_ids(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    uint32_t *ids;
    Py_ssize_t count = 0;
    Py_ssize_t start = 0;
    Py_ssize_t stop = 0;
    PyObject *result;

    (void)module;
    if (!PyBytes_Check(arg)) { /* parse_array relies on the NUL byte after a bytes object's data */
        PyErr_SetString(PyExc_TypeError, "find_token_ids() wants bytes");
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    ids = id_room(view.len);
    if (ids == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (find_ids((const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len, ids, &count,
                 &start, &stop) == 0) {
        PyObject *packed = packed_bytes(ids, count);

        result = packed == NULL ? NULL : Py_BuildValue("(Nnn)", packed, start, stop);
    } else {
        result = Py_NewRef(Py_None);
    }
    PyMem_Free(ids);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef token_ids_methods[] = {
    {"find_token_ids", find_token_ids, METH_O, find_token_ids_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef token_ids_module = {
    PyModuleDef_HEAD_INIT,
    "kvindex.api._token_ids",
    "A score request's token_ids read straight into the hasher's packed form.",
    0,
    token_ids_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__token_ids(void)
{
    return PyModule_Create(&token_ids_module);
}
