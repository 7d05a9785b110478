/* quarry._cpieces: cl100k_base's pre-tokenizer and a cache of per-piece token
 * counts, in C.
 *
 * The same splitting as quarry._pieces.pretokenize (cl100k_base's regex,
 * written out as a scanner), over the characters quarry._pieces can split;
 * which class each of those characters is in comes from Python (configure), so
 * both implementations share one definition. Counting a text sums cached
 * per-piece counts held in an open-addressing table keyed by the piece's code
 * points: no Python object is made for a piece the table knows. A piece it
 * does not know is counted by the Python callable given to configure (one
 * piece's BPE, by tiktoken).
 *
 * Everything runs under the GIL. The count callable may let another thread in,
 * so no pointer into the table is held across a call to it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Character classes (configure's table holds one byte per code point below
 * TABLE_SIZE; code points at or above it are OUTSIDE). */
enum { OUTSIDE = 0, LETTER = 1, NUMBER = 2, SPACE = 3, OTHER = 4 };
#define TABLE_SIZE 0x2C00

typedef struct {
    uint64_t hash;  /* 0: empty slot */
    uint32_t offset; /* into the arena, in code points */
    uint32_t length;
    Py_ssize_t count;
} Entry;

static PyObject *classes_obj = NULL; /* bytes of TABLE_SIZE */
static const uint8_t *classes = NULL;
static PyObject *count_fn = NULL;
static Py_ssize_t max_entries = 200000;
static Py_ssize_t max_cached_length = 48;

static Entry *entries = NULL;
static size_t capacity = 0; /* a power of two, at least 2 * max_entries */
static Py_ssize_t used = 0;
static uint32_t *arena = NULL;
static size_t arena_length = 0;
static size_t arena_capacity = 0;

/* A lookup gives up (the piece is counted, not cached) after this many slots, so
 * text made of pieces whose hashes collide costs no more than counting them. */
#define MAX_PROBES 64

#define CLASS_OF(c) ((c) < TABLE_SIZE ? classes[(c)] : OUTSIDE)
#define IS_CR_LF(c) ((c) == '\r' || (c) == '\n')

/* The end of the piece that starts at i, in text[.. n) read as a text of its
 * own. Every character in the range is countable (checked before). */
#define DEFINE_PIECE_END(NAME, T)                                                         \
    static Py_ssize_t NAME(const T *s, Py_ssize_t i, Py_ssize_t n)                        \
    {                                                                                     \
        Py_UCS4 c = s[i];                                                                 \
        uint8_t k = CLASS_OF(c);                                                          \
        Py_ssize_t j;                                                                     \
        /* '(?i:[sdmt]|ll|ve|re) */                                                       \
        if (c == '\'' && i + 1 < n && s[i + 1] < 0x80) {                                  \
            Py_UCS4 d = s[i + 1] | 0x20;                                                  \
            if (d == 's' || d == 'd' || d == 'm' || d == 't')                             \
                return i + 2;                                                             \
            if (i + 2 < n && s[i + 2] < 0x80) {                                           \
                Py_UCS4 e = s[i + 2] | 0x20;                                              \
                if ((d == 'l' && e == 'l') || (d == 'v' && e == 'e') ||                   \
                    (d == 'r' && e == 'e'))                                               \
                    return i + 3;                                                         \
            }                                                                             \
        }                                                                                 \
        /* [^\r\n\p{L}\p{N}]?+\p{L}++ */                                                  \
        j = (k != LETTER && k != NUMBER && !IS_CR_LF(c)) ? i + 1 : i;                     \
        if (j < n && CLASS_OF(s[j]) == LETTER) {                                          \
            j++;                                                                          \
            while (j < n && CLASS_OF(s[j]) == LETTER)                                     \
                j++;                                                                      \
            return j;                                                                     \
        }                                                                                 \
        /* \p{N}{1,3}+ */                                                                 \
        if (k == NUMBER) {                                                                \
            j = i + 1;                                                                    \
            while (j < n && j < i + 3 && CLASS_OF(s[j]) == NUMBER)                        \
                j++;                                                                      \
            return j;                                                                     \
        }                                                                                 \
        /*  ?[^\s\p{L}\p{N}]++[\r\n]*+ */                                                 \
        j = (c == ' ' && i + 1 < n && CLASS_OF(s[i + 1]) == OTHER) ? i + 1 : i;           \
        if (CLASS_OF(s[j]) == OTHER) {                                                    \
            j++;                                                                          \
            while (j < n && CLASS_OF(s[j]) == OTHER)                                      \
                j++;                                                                      \
            while (j < n && IS_CR_LF(s[j]))                                               \
                j++;                                                                      \
            return j;                                                                     \
        }                                                                                 \
        /* Whitespace: \s++$ | \s*[\r\n] | \s+(?!\S) | \s */                              \
        j = i + 1;                                                                        \
        while (j < n && CLASS_OF(s[j]) == SPACE)                                          \
            j++;                                                                          \
        if (j == n)                                                                       \
            return n;                                                                     \
        for (Py_ssize_t p = j - 1; p >= i; p--) {                                         \
            if (IS_CR_LF(s[p]))                                                           \
                return p + 1;                                                             \
        }                                                                                 \
        return j - 1 > i ? j - 1 : i + 1;                                                 \
    }                                                                                     \
                                                                                          \
    static int NAME##_countable(const T *s, Py_ssize_t i, Py_ssize_t n)                   \
    {                                                                                     \
        for (; i < n; i++) {                                                              \
            if (CLASS_OF(s[i]) == OUTSIDE)                                                \
                return 0;                                                                 \
        }                                                                                 \
        return 1;                                                                         \
    }                                                                                     \
                                                                                          \
    static uint64_t NAME##_hash(const T *s, Py_ssize_t a, Py_ssize_t b)                   \
    {                                                                                     \
        uint64_t h = 1469598103934665603ULL;                                              \
        for (; a < b; a++) {                                                              \
            h ^= (uint64_t)s[a];                                                          \
            h *= 1099511628211ULL;                                                        \
        }                                                                                 \
        return h | 1; /* never 0, the empty mark */                                       \
    }                                                                                     \
                                                                                          \
    static Entry *NAME##_find(const T *s, Py_ssize_t a, Py_ssize_t b, uint64_t h)         \
    {                                                                                     \
        size_t mask = capacity - 1;                                                       \
        size_t slot = (size_t)h & mask;                                                   \
        uint32_t length = (uint32_t)(b - a);                                              \
        for (int probes = 0; probes < MAX_PROBES; probes++) {                             \
            Entry *e = &entries[slot];                                                    \
            if (e->hash == 0)                                                             \
                return e;                                                                 \
            if (e->hash == h && e->length == length) {                                    \
                const uint32_t *stored = arena + e->offset;                               \
                Py_ssize_t m = 0;                                                         \
                while (m < (Py_ssize_t)length && stored[m] == (uint32_t)s[a + m])         \
                    m++;                                                                  \
                if (m == (Py_ssize_t)length)                                              \
                    return e;                                                             \
            }                                                                             \
            slot = (slot + 1) & mask;                                                     \
        }                                                                                 \
        return NULL; /* a long run of colliding pieces: not cached */                     \
    }                                                                                     \
                                                                                          \
    static int NAME##_store(const T *s, Py_ssize_t a, Py_ssize_t b, uint64_t h,           \
                            Py_ssize_t count)                                             \
    {                                                                                     \
        if (used >= max_entries)                                                          \
            forget();                                                                     \
        Entry *e = NAME##_find(s, a, b, h);                                               \
        if (e == NULL || e->hash != 0)                                                    \
            return 0; /* no room near its slot, or stored meanwhile by another caller */  \
        size_t length = (size_t)(b - a);                                                  \
        if (arena_length + length > arena_capacity) {                                     \
            size_t grown = arena_capacity ? arena_capacity * 2 : 65536;                   \
            while (grown < arena_length + length)                                         \
                grown *= 2;                                                               \
            uint32_t *bigger = PyMem_Realloc(arena, grown * sizeof(uint32_t));            \
            if (bigger == NULL) {                                                         \
                PyErr_NoMemory();                                                         \
                return -1;                                                                \
            }                                                                             \
            arena = bigger;                                                               \
            arena_capacity = grown;                                                       \
        }                                                                                 \
        for (size_t m = 0; m < length; m++)                                               \
            arena[arena_length + m] = (uint32_t)s[a + (Py_ssize_t)m];                     \
        e->hash = h;                                                                      \
        e->offset = (uint32_t)arena_length;                                               \
        e->length = (uint32_t)length;                                                     \
        e->count = count;                                                                 \
        arena_length += length;                                                           \
        used++;                                                                           \
        return 0;                                                                         \
    }

static void
forget(void)
{
    if (entries != NULL)
        memset(entries, 0, capacity * sizeof(Entry));
    used = 0;
    arena_length = 0;
}

DEFINE_PIECE_END(end_1, Py_UCS1)
DEFINE_PIECE_END(end_2, Py_UCS2)
DEFINE_PIECE_END(end_4, Py_UCS4)

static int
check_configured(int counting)
{
    if (classes == NULL || (counting && (count_fn == NULL || entries == NULL))) {
        PyErr_SetString(PyExc_RuntimeError,
                        counting ? "quarry._cpieces: call configure and set_counter first"
                                 : "quarry._cpieces: call configure first");
        return -1;
    }
    return 0;
}

/* Parse (text, start, end); a range outside the text is a ValueError. */
static int
parse_range(PyObject *const *args, Py_ssize_t nargs, PyObject **text, Py_ssize_t *start,
            Py_ssize_t *end)
{
    if (nargs != 3 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "expected (text: str, start: int, end: int)");
        return -1;
    }
    *text = args[0];
    Py_ssize_t n = PyUnicode_GET_LENGTH(args[0]);
    *start = PyLong_AsSsize_t(args[1]);
    if (*start == -1 && PyErr_Occurred())
        return -1;
    *end = PyLong_AsSsize_t(args[2]);
    if (*end == -1 && PyErr_Occurred())
        return -1;
    if (*start < 0 || *end > n || *start > *end) {
        PyErr_SetString(PyExc_ValueError, "range out of the text");
        return -1;
    }
    return 0;
}

/* Count one piece text[a:b): from the table, else by count_fn (cached when short). */
#define DEFINE_COUNT_PIECE(NAME, T, PIECE)                                                \
    static Py_ssize_t NAME(PyObject *text, const T *s, Py_ssize_t a, Py_ssize_t b)        \
    {                                                                                     \
        int cacheable = b - a <= max_cached_length;                                       \
        uint64_t h = 0;                                                                   \
        if (cacheable) {                                                                  \
            h = PIECE##_hash(s, a, b);                                                    \
            Entry *e = PIECE##_find(s, a, b, h);                                          \
            if (e != NULL && e->hash != 0)                                                \
                return e->count;                                                          \
        }                                                                                 \
        PyObject *piece = PyUnicode_Substring(text, a, b);                                \
        if (piece == NULL)                                                                \
            return -1;                                                                    \
        /* Held for the call: set_counter may replace count_fn while it runs. */          \
        PyObject *fn = Py_NewRef(count_fn);                                               \
        PyObject *result = PyObject_CallOneArg(fn, piece);                                \
        Py_DECREF(fn);                                                                    \
        Py_DECREF(piece);                                                                 \
        if (result == NULL)                                                               \
            return -1;                                                                    \
        Py_ssize_t count = PyLong_AsSsize_t(result);                                      \
        Py_DECREF(result);                                                                \
        if (count < 0) {                                                                  \
            if (!PyErr_Occurred())                                                        \
                PyErr_SetString(PyExc_ValueError, "a piece's count must be >= 0");      \
            return -1;                                                                    \
        }                                                                                 \
        /* s stays valid: text is immutable and held by the caller. */                   \
        if (cacheable && PIECE##_store(s, a, b, h, count) < 0)                            \
            return -1;                                                                    \
        return count;                                                                     \
    }                                                                                     \
                                                                                          \
    static PyObject *NAME##_total(PyObject *text, const T *s, Py_ssize_t i, Py_ssize_t n) \
    {                                                                                     \
        if (!PIECE##_countable(s, i, n))                                                  \
            Py_RETURN_NONE;                                                               \
        Py_ssize_t total = 0;                                                             \
        while (i < n) {                                                                   \
            Py_ssize_t j = PIECE(s, i, n);                                                \
            Py_ssize_t count = NAME(text, s, i, j);                                       \
            if (count < 0)                                                                \
                return NULL;                                                              \
            if (total > PY_SSIZE_T_MAX - count) {                                         \
                PyErr_SetString(PyExc_OverflowError, "token count too large");           \
                return NULL;                                                              \
            }                                                                             \
            total += count;                                                               \
            i = j;                                                                        \
        }                                                                                 \
        return PyLong_FromSsize_t(total);                                                 \
    }                                                                                     \
                                                                                          \
    static PyObject *NAME##_split(PyObject *text, const T *s, Py_ssize_t i, Py_ssize_t n) \
    {                                                                                     \
        if (!PIECE##_countable(s, i, n))                                                  \
            Py_RETURN_NONE;                                                               \
        PyObject *pieces = PyList_New(0);                                                 \
        if (pieces == NULL)                                                               \
            return NULL;                                                                  \
        while (i < n) {                                                                   \
            Py_ssize_t j = PIECE(s, i, n);                                                \
            PyObject *piece = PyUnicode_Substring(text, i, j);                            \
            if (piece == NULL || PyList_Append(pieces, piece) < 0) {                      \
                Py_XDECREF(piece);                                                        \
                Py_DECREF(pieces);                                                        \
                return NULL;                                                              \
            }                                                                             \
            Py_DECREF(piece);                                                             \
            i = j;                                                                        \
        }                                                                                 \
        return pieces;                                                                    \
    }

DEFINE_COUNT_PIECE(count_1, Py_UCS1, end_1)
DEFINE_COUNT_PIECE(count_2, Py_UCS2, end_2)
DEFINE_COUNT_PIECE(count_4, Py_UCS4, end_4)

PyDoc_STRVAR(count_doc,
             "count(text, start, end) -> int | None\n\n"
             "The cl100k_base token count of text[start:end], or None when it holds a\n"
             "character outside the countable set.");

static PyObject *
cpieces_count(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *text;
    Py_ssize_t start, end;
    if (check_configured(1) < 0 || parse_range(args, nargs, &text, &start, &end) < 0)
        return NULL;
    /* The text is borrowed from the caller's arguments; keep it alive across count_fn. */
    Py_INCREF(text);
    PyObject *result;
    switch (PyUnicode_KIND(text)) {
    case PyUnicode_1BYTE_KIND:
        result = count_1_total(text, PyUnicode_1BYTE_DATA(text), start, end);
        break;
    case PyUnicode_2BYTE_KIND:
        result = count_2_total(text, PyUnicode_2BYTE_DATA(text), start, end);
        break;
    default:
        result = count_4_total(text, PyUnicode_4BYTE_DATA(text), start, end);
        break;
    }
    Py_DECREF(text);
    return result;
}

PyDoc_STRVAR(split_doc,
             "split(text, start, end) -> list[str] | None\n\n"
             "cl100k_base's pre-tokenizer pieces of text[start:end], or None when it holds\n"
             "a character outside the countable set.");

static PyObject *
cpieces_split(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *text;
    Py_ssize_t start, end;
    if (check_configured(0) < 0 || parse_range(args, nargs, &text, &start, &end) < 0)
        return NULL;
    switch (PyUnicode_KIND(text)) {
    case PyUnicode_1BYTE_KIND:
        return count_1_split(text, PyUnicode_1BYTE_DATA(text), start, end);
    case PyUnicode_2BYTE_KIND:
        return count_2_split(text, PyUnicode_2BYTE_DATA(text), start, end);
    default:
        return count_4_split(text, PyUnicode_4BYTE_DATA(text), start, end);
    }
}

PyDoc_STRVAR(piece_doc,
             "piece(piece) -> int\n\n"
             "The token count of one pre-tokenizer piece, from the table (counted and\n"
             "stored on a miss), as if the text were that piece alone.");

static PyObject *
cpieces_piece(PyObject *module, PyObject *piece)
{
    if (check_configured(1) < 0)
        return NULL;
    if (!PyUnicode_Check(piece)) {
        PyErr_SetString(PyExc_TypeError, "piece must be a str");
        return NULL;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(piece);
    Py_ssize_t count;
    if (n == 0)
        return PyLong_FromLong(0);
    Py_INCREF(piece);
    switch (PyUnicode_KIND(piece)) {
    case PyUnicode_1BYTE_KIND:
        count = count_1(piece, PyUnicode_1BYTE_DATA(piece), 0, n);
        break;
    case PyUnicode_2BYTE_KIND:
        count = count_2(piece, PyUnicode_2BYTE_DATA(piece), 0, n);
        break;
    default:
        count = count_4(piece, PyUnicode_4BYTE_DATA(piece), 0, n);
        break;
    }
    Py_DECREF(piece);
    return count < 0 ? NULL : PyLong_FromSsize_t(count);
}

PyDoc_STRVAR(configure_doc,
             "configure(classes) -> None\n\n"
             "classes: bytes, one class per code point below 0x2C00 (0 not countable,\n"
             "1 letter, 2 number, 3 whitespace, 4 other), as quarry._pieces reads them.");

static PyObject *
cpieces_configure(PyObject *module, PyObject *table)
{
    if (!PyBytes_Check(table) || PyBytes_GET_SIZE(table) != TABLE_SIZE) {
        PyErr_Format(PyExc_ValueError, "classes must be bytes of length %d", TABLE_SIZE);
        return NULL;
    }
    Py_INCREF(table);
    Py_XSETREF(classes_obj, table);
    classes = (const uint8_t *)PyBytes_AS_STRING(table);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_counter_doc,
             "set_counter(count, max_entries, max_cached_length) -> None\n\n"
             "count: str -> int, one piece's token count; the table holds at most\n"
             "max_entries pieces (it starts again from empty when full) of at most\n"
             "max_cached_length characters. Empties the table.");

static PyObject *
cpieces_set_counter(PyObject *module, PyObject *args)
{
    PyObject *fn;
    Py_ssize_t entries_max, length_max;
    if (!PyArg_ParseTuple(args, "Onn", &fn, &entries_max, &length_max))
        return NULL;
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "count must be callable");
        return NULL;
    }
    /* The arena is addressed with 32-bit offsets: it must be able to hold a full table. */
    if (entries_max < 1 || entries_max > 0x10000000 || length_max < 0 || length_max > 0xFFFF ||
        (uint64_t)entries_max * (uint64_t)length_max >= 0xFFFFFFFFULL) {
        PyErr_SetString(PyExc_ValueError,
                        "1 <= max_entries <= 2**28, 0 <= max_cached_length <= 65535, and "
                        "max_entries * max_cached_length < 2**32");
        return NULL;
    }
    size_t wanted = 16;
    while (wanted < (size_t)entries_max * 2)
        wanted *= 2;
    Entry *table_entries = PyMem_Calloc(wanted, sizeof(Entry));
    if (table_entries == NULL)
        return PyErr_NoMemory();
    PyMem_Free(entries);
    entries = table_entries;
    capacity = wanted;
    max_entries = entries_max;
    max_cached_length = length_max;
    Py_INCREF(fn);
    Py_XSETREF(count_fn, fn);
    forget();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(clear_doc, "clear() -> None\n\nEmpty the table of per-piece counts.");

static PyObject *
cpieces_clear(PyObject *module, PyObject *unused)
{
    forget();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(size_doc, "size() -> int\n\nHow many pieces the table holds.");

static PyObject *
cpieces_size(PyObject *module, PyObject *unused)
{
    return PyLong_FromSsize_t(used);
}

static PyMethodDef cpieces_methods[] = {
    {"count", (PyCFunction)(void (*)(void))cpieces_count, METH_FASTCALL, count_doc},
    {"split", (PyCFunction)(void (*)(void))cpieces_split, METH_FASTCALL, split_doc},
    {"piece", cpieces_piece, METH_O, piece_doc},
    {"configure", cpieces_configure, METH_O, configure_doc},
    {"set_counter", cpieces_set_counter, METH_VARARGS, set_counter_doc},
    {"clear", cpieces_clear, METH_NOARGS, clear_doc},
    {"size", cpieces_size, METH_NOARGS, size_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cpieces_module = {
    PyModuleDef_HEAD_INIT,
    "quarry._cpieces",
    "cl100k_base's pre-tokenizer and cached per-piece token counts, in C (see quarry._pieces).",
    -1,
    cpieces_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__cpieces(void)
{
    return PyModule_Create(&cpieces_module);
}
