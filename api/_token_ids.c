/* kvindex.api._token_ids: a score request's `token_ids` (a JSON array, as msgspec.Raw hands it over)
 * packed as native uint32, the form the hasher's memo keys on (array('I', ids).tobytes()).
 *
 * Decoding 8,192 ids into a list of PyLongs was the largest server-side cost of a token request (~150 us
 * of msgspec's time, then ~15 us to pack them again for the memo); this reads the digits once, into the
 * packed form, with no Python object per id.
 *
 * Only the plain shape is read: `[`, ints in [0, 2**32) written as JSON writes them (no sign, fraction,
 * exponent or leading zero), separated by commas, `]`, with JSON whitespace anywhere between. Anything
 * else returns None and the caller decodes the request the ordinary way, which accepts or refuses it with
 * its exact message: this reader never judges a request, it only declines it. msgspec has already
 * checked that the bytes are one well-formed JSON value before they get here.
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

/* The number of ids in [p, end) if it is the plain shape, written to out (room for one id per two
 * bytes); -1 if it is not. */
static Py_ssize_t
parse_ids(const unsigned char *p, const unsigned char *end, uint32_t *out)
{
    Py_ssize_t count = 0;

    while (p < end && is_ws(*p)) {
        p++;
    }
    if (p == end || *p++ != '[') {
        return -1;
    }
    while (p < end && is_ws(*p)) {
        p++;
    }
    if (p < end && *p == ']') {
        p++;
    } else {
        for (;;) {
            uint64_t value;

            if (p == end || *p < '0' || *p > '9') {
                return -1;
            }
            value = (uint64_t)(*p++ - '0');
            if (value == 0) {
                if (p < end && *p >= '0' && *p <= '9') {
                    return -1; /* a leading zero: not JSON */
                }
            } else {
                while (p < end && *p >= '0' && *p <= '9') {
                    value = value * 10 + (uint64_t)(*p++ - '0');
                    if (value > UINT32_MAX) {
                        return -1; /* out of range (and no overflow: at most 10 digits get here) */
                    }
                }
            }
            out[count++] = (uint32_t)value;
            while (p < end && is_ws(*p)) {
                p++;
            }
            if (p == end) {
                return -1;
            }
            if (*p == ',') {
                p++;
                while (p < end && is_ws(*p)) {
                    p++;
                }
                continue;
            }
            if (*p == ']') {
                p++;
                break;
            }
            return -1; /* a fraction, an exponent, or anything but a separator */
        }
    }
    while (p < end && is_ws(*p)) {
        p++;
    }
    return p == end ? count : -1;
}

PyDoc_STRVAR(pack_json_ids_doc,
"pack_json_ids(data, /)\n--\n\n"
"The JSON array `data` (any bytes-like object) of token ids packed as native uint32, as\n"
"array('I', ids).tobytes() packs them; None unless it is a plain array of ints in [0, 2**32).");

static PyObject *
pack_json_ids(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    uint32_t *ids;
    Py_ssize_t count;
    PyObject *packed = NULL;

    (void)module;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    /* n ids take at least 2n + 1 bytes ("[" and a digit plus a separator each). */
    ids = PyMem_Malloc((size_t)(view.len / 2 + 1) * sizeof(uint32_t));
    if (ids == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    count = parse_ids((const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len, ids);
    PyBuffer_Release(&view);
    if (count >= 0) {
        packed = PyBytes_FromStringAndSize((const char *)ids, count * (Py_ssize_t)sizeof(uint32_t));
    } else {
        packed = Py_NewRef(Py_None);
    }
    PyMem_Free(ids);
    return packed;
}

static PyMethodDef token_ids_methods[] = {
    {"pack_json_ids", pack_json_ids, METH_O, pack_json_ids_doc},
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
