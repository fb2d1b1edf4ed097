/* narwhal.core._fastevent: the relay step of one common engine read, in C (issue 25).

   event(data, client_ids, limit) -> (framed, k) | None

   `data` is one read of an engine's HTTP/1.1 chunked body taken at a chunk boundary. The
   function answers only for the common read of a started stream -- exactly one whole
   chunk holding exactly one whole SSE event `data: <json>\n\n` whose JSON is an object
   with no `error` and no `usage` member and a non-empty `choices` list, every choice an
   object with a non-empty `token_ids` list of nonnegative integers (T02-T04) and no
   `finish_reason` but null -- and declines (None) for anything else, which the caller
   then feeds to the Python relay (core/relay.py) as it always has. Declining is always
   correct; answering must give exactly what the Python path gives:

     * `framed`: the client's bytes as H1Direct.write frames them, `%x\r\n<out>\r\n`, with
       <out> = `data: <json'>\n\n`. With client_ids the JSON goes on byte for byte; without,
       json' is what orjson.dumps writes for the object with T10's fields removed
       (top-level `prompt_token_ids`; per choice `token_ids` and `prompt_token_ids`).
     * `k`: the token IDs the event carried (T04), >= 1.

   Invariant: the JSON accepted is a subset of what orjson accepts, on which orjson.loads
   then orjson.dumps is the identity up to insignificant whitespace. So the scan declines
   floats, integers of more than 18 digits (orjson reads longer ones as floats) and -0;
   duplicate keys (orjson keeps the last value at the first place); string escapes other
   than the ones orjson writes (\" \\ \b \t \n \f \r, and \u00xx in lower case for the
   other control characters); invalid UTF-8; nesting past MAX_DEPTH. The Python relay
   stays the reference: tests/core/test_fastevent.py checks every answer against it.

   Sans-IO: no socket, no clock, no Python object but the arguments and the result. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_DEPTH 64
#define MAX_KEYS 64        /* members of one object whose keys are compared for duplicates */
#define MAX_INT_DIGITS 18  /* |n| < 10^18: an int64 in orjson, never a float */
#define STACK_OUT 8192

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
    unsigned char *out;   /* NULL: validate only (client_ids: the JSON goes on as it came) */
    Py_ssize_t n;         /* bytes written to out */
    long long ids;        /* token IDs counted */
    int depth;
} Scan;

enum { OK = 0, NO = -1 };

static inline void ws(Scan *s) {
    /* the SSE line holds no CR or LF (checked before): blanks are space and tab */
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t')) s->p++;
}

static inline void emit(Scan *s, const unsigned char *from, Py_ssize_t len) {
    if (s->out != NULL) {
        memcpy(s->out + s->n, from, (size_t)len);
        s->n += len;
    }
}

static inline void emit1(Scan *s, unsigned char c) {
    if (s->out != NULL) s->out[s->n++] = c;
}

static inline int hexlow(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
}

/* A string at s->p (its opening quote), read through its closing quote and emitted as
   it came; *start and *len: the raw bytes between the quotes (for key comparison). */
static int string(Scan *s, const unsigned char **start, Py_ssize_t *len) {
    const unsigned char *p = s->p, *end = s->end, *b = p;
    if (p >= end || *p != '"') return NO;
    p++;
    const unsigned char *first = p;
    while (1) {
        if (p >= end) return NO;
        unsigned char c = *p;
        if (c == '"') break;
        if (c < 0x20) return NO;                   /* a raw control character: not JSON */
        if (c == '\\') {
            if (p + 1 >= end) return NO;
            unsigned char e = p[1];
            if (e == '"' || e == '\\' || e == 'b' || e == 't' || e == 'n' || e == 'f' || e == 'r') {
                p += 2;
                continue;
            }
            if (e != 'u' || p + 6 > end) return NO;  /* \/ and the rest: orjson writes them otherwise */
            /* \u00xx for a control character orjson has no short form for */
            if (p[2] != '0' || p[3] != '0' || !(p[4] == '0' || p[4] == '1') || !hexlow(p[5])) return NO;
            {
                int v = (p[4] - '0') * 16 + (p[5] <= '9' ? p[5] - '0' : p[5] - 'a' + 10);
                if (v == 0x08 || v == 0x09 || v == 0x0a || v == 0x0c || v == 0x0d) return NO;
            }
            p += 6;
            continue;
        }
        if (c < 0x80) { p++; continue; }
        /* UTF-8, strict: no overlong form, no surrogate, nothing past U+10FFFF */
        if (c >= 0xC2 && c <= 0xDF) {
            if (p + 1 >= end || (p[1] & 0xC0) != 0x80) return NO;
            p += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (p + 2 >= end || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return NO;
            if (c == 0xE0 && p[1] < 0xA0) return NO;
            if (c == 0xED && p[1] > 0x9F) return NO;
            p += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (p + 3 >= end || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return NO;
            if (c == 0xF0 && p[1] < 0x90) return NO;
            if (c == 0xF4 && p[1] > 0x8F) return NO;
            p += 4;
        } else {
            return NO;
        }
    }
    *start = first;
    *len = p - first;
    p++;  /* the closing quote */
    emit(s, b, p - b);
    s->p = p;
    return OK;
}

/* An integer in its canonical form (what orjson writes back); *neg: it had a minus. */
static int integer(Scan *s, int *neg) {
    const unsigned char *p = s->p, *end = s->end, *b = p;
    *neg = 0;
    if (p < end && *p == '-') { *neg = 1; p++; }
    if (p >= end || *p < '0' || *p > '9') return NO;
    if (*p == '0') {
        p++;
        if (*neg) return NO;                      /* -0: orjson writes 0 */
        if (p < end && *p >= '0' && *p <= '9') return NO;  /* a leading zero: not JSON */
    } else {
        const unsigned char *d = p;
        while (p < end && *p >= '0' && *p <= '9') p++;
        if (p - d > MAX_INT_DIGITS) return NO;
    }
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) return NO;  /* a float */
    emit(s, b, p - b);
    s->p = p;
    return OK;
}

static int value(Scan *s);

static int literal(Scan *s, const char *word, Py_ssize_t len) {
    if (s->end - s->p < len || memcmp(s->p, word, (size_t)len) != 0) return NO;
    emit(s, s->p, len);
    s->p += len;
    return OK;
}

/* Keys seen in one object, for the duplicate check. */
typedef struct {
    const unsigned char *k[MAX_KEYS];
    Py_ssize_t len[MAX_KEYS];
    int n;
} Keys;

static int key_new(Keys *keys, const unsigned char *k, Py_ssize_t len) {
    for (int i = 0; i < keys->n; i++) {
        if (keys->len[i] == len && memcmp(keys->k[i], k, (size_t)len) == 0) return NO;
    }
    if (keys->n >= MAX_KEYS) return NO;
    keys->k[keys->n] = k;
    keys->len[keys->n] = len;
    keys->n++;
    return OK;
}

#define KEY_IS(k, len, lit) ((len) == (Py_ssize_t)(sizeof(lit) - 1) && memcmp((k), (lit), sizeof(lit) - 1) == 0)

/* What an object is, for its members' rules. */
enum { PLAIN = 0, TOP = 1, CHOICE = 2 };

/* What an array is, for its elements' rules. */
enum { ANY = 0, CHOICES = 1, IDS = 2 };

static int array(Scan *s, int kind);

/* An object at s->p. TOP: the event; CHOICE: one of its choices. */
static int object(Scan *s, int kind) {
    Keys keys;
    keys.n = 0;
    int emitted = 0, has_ids = 0;
    if (++s->depth > MAX_DEPTH) return NO;
    s->p++;  /* { */
    emit1(s, '{');
    ws(s);
    if (s->p < s->end && *s->p == '}') {
        s->p++;
    } else {
        while (1) {
            const unsigned char *k;
            Py_ssize_t klen;
            Py_ssize_t mark = s->n;
            if (emitted) emit1(s, ',');
            if (string(s, &k, &klen) != OK) return NO;
            if (key_new(&keys, k, klen) != OK) return NO;
            ws(s);
            if (s->p >= s->end || *s->p != ':') return NO;
            s->p++;
            emit1(s, ':');
            ws(s);
            if (s->p >= s->end) return NO;
            int drop = 0;  /* T10: a member the client does not get */
            if (kind == TOP) {
                if (KEY_IS(k, klen, "error") || KEY_IS(k, klen, "usage")) return NO;  /* the Python path's */
                if (KEY_IS(k, klen, "choices")) {
                    if (array(s, CHOICES) != OK) return NO;
                } else {
                    drop = KEY_IS(k, klen, "prompt_token_ids");
                    if (value(s) != OK) return NO;
                }
            } else if (kind == CHOICE) {
                if (KEY_IS(k, klen, "token_ids")) {
                    if (array(s, IDS) != OK) return NO;
                    has_ids = 1;
                    drop = 1;
                } else if (KEY_IS(k, klen, "finish_reason")) {
                    if (literal(s, "null", 4) != OK) return NO;  /* the last event: the Python path's */
                } else {
                    drop = KEY_IS(k, klen, "prompt_token_ids");
                    if (value(s) != OK) return NO;
                }
            } else if (value(s) != OK) {
                return NO;
            }
            if (drop) {
                s->n = mark;  /* the member and its comma unwritten */
            } else {
                emitted = 1;
            }
            ws(s);
            if (s->p >= s->end) return NO;
            if (*s->p == ',') {
                s->p++;
                ws(s);
                continue;
            }
            if (*s->p == '}') {
                s->p++;
                break;
            }
            return NO;
        }
    }
    emit1(s, '}');
    s->depth--;
    if (kind == CHOICE && !has_ids) return NO;  /* T02 and the rest: the Python path's */
    return OK;
}

/* An array at s->p. ANY: any values. CHOICES: the event's `choices`, a non-empty list of
   choice objects. IDS: a choice's `token_ids`, a non-empty list of nonnegative integers
   (T03), counted (T04); its caller drops it from the client's copy when stripping. */
static int array(Scan *s, int kind) {
    long long n = 0;
    if (s->p >= s->end || *s->p != '[') return NO;
    if (++s->depth > MAX_DEPTH) return NO;
    s->p++;
    emit1(s, '[');
    ws(s);
    if (s->p < s->end && *s->p == ']') {
        if (kind != ANY) return NO;  /* no choice, or no ID: the Python path's */
        s->p++;
    } else {
        while (1) {
            int neg;
            if (n) emit1(s, ',');
            if (kind == CHOICES) {
                if (s->p >= s->end || *s->p != '{' || object(s, CHOICE) != OK) return NO;  /* a choice that is not an object */
            } else if (kind == IDS) {
                if (integer(s, &neg) != OK || neg) return NO;  /* negative, or not an integer */
            } else if (value(s) != OK) {
                return NO;
            }
            n++;
            ws(s);
            if (s->p >= s->end) return NO;
            if (*s->p == ',') { s->p++; ws(s); continue; }
            if (*s->p == ']') { s->p++; break; }
            return NO;
        }
    }
    emit1(s, ']');
    s->depth--;
    if (kind == IDS) s->ids += n;
    return OK;
}

static int value(Scan *s) {
    if (s->p >= s->end) return NO;
    const unsigned char *k;
    Py_ssize_t klen;
    int neg;
    switch (*s->p) {
    case '{': return object(s, PLAIN);
    case '[': return array(s, ANY);
    case '"': return string(s, &k, &klen);
    case 't': return literal(s, "true", 4);
    case 'f': return literal(s, "false", 5);
    case 'n': return literal(s, "null", 4);
    default: return integer(s, &neg);
    }
}

static inline int hexval(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static PyObject *event(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "event(data: bytes, client_ids: bool, limit: int)");
        return NULL;
    }
    int client_ids = PyObject_IsTrue(args[1]);
    if (client_ids < 0) return NULL;
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit == -1 && PyErr_Occurred()) return NULL;

    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]);

    /* the chunk: 1-16 hex digits alone, CRLF, exactly `size` bytes, CRLF (http1.py's
       common read; a size line with an extension or blanks is the Python path's) */
    Py_ssize_t i = 0;
    unsigned long long size = 0;
    while (i < len && i < 17 && hexval(d[i]) >= 0) {
        size = size * 16 + (unsigned long long)hexval(d[i]);
        i++;
    }
    if (i == 0 || i > 16 || i + 1 >= len || d[i] != '\r' || d[i + 1] != '\n') Py_RETURN_NONE;
    Py_ssize_t body = i + 2;
    if (size == 0 || size > (unsigned long long)len || (Py_ssize_t)size != len - body - 2) Py_RETURN_NONE;
    if (d[len - 2] != '\r' || d[len - 1] != '\n') Py_RETURN_NONE;
    const unsigned char *pl = d + body;
    Py_ssize_t plen = (Py_ssize_t)size;

    /* the event: `data: ` one line `\n\n`, no CR (sse.py's one-event read), within limit */
    if (plen < 8 || memcmp(pl, "data: ", 6) != 0 || pl[plen - 1] != '\n' || pl[plen - 2] != '\n') Py_RETURN_NONE;
    if (memchr(pl, '\n', (size_t)(plen - 2)) != NULL || memchr(pl, '\r', (size_t)plen) != NULL) Py_RETURN_NONE;
    if (plen - 7 > limit) Py_RETURN_NONE;
    const unsigned char *js = pl + 6;
    Py_ssize_t jlen = plen - 8;

    unsigned char stack_out[STACK_OUT];
    unsigned char *out = NULL;
    if (!client_ids) {
        out = jlen <= STACK_OUT ? stack_out : (unsigned char *)PyMem_Malloc((size_t)jlen);
        if (out == NULL) return PyErr_NoMemory();
    }
    Scan s = {js, js + jlen, out, 0, 0, 0};
    int r = NO;
    ws(&s);
    if (s.p < s.end && *s.p == '{' && object(&s, TOP) == OK) {
        ws(&s);
        r = (s.p == s.end && s.ids > 0) ? OK : NO;
    }
    /* an event without `choices` counts no ID: declined above (s.ids == 0) */
    PyObject *result = NULL;
    if (r == OK) {
        const unsigned char *j = client_ids ? js : out;
        Py_ssize_t n = client_ids ? jlen : s.n;
        Py_ssize_t olen = n + 8;  /* data: ... \n\n */
        char head[20];
        int hl = snprintf(head, sizeof head, "%zx\r\n", (size_t)olen);
        PyObject *b = PyBytes_FromStringAndSize(NULL, hl + olen + 2);
        if (b != NULL) {
            char *w = PyBytes_AS_STRING(b);
            memcpy(w, head, (size_t)hl);
            w += hl;
            memcpy(w, "data: ", 6);
            memcpy(w + 6, j, (size_t)n);
            memcpy(w + 6 + n, "\n\n\r\n", 4);
            result = Py_BuildValue("(NL)", b, s.ids);
        }
    } else {
        result = Py_NewRef(Py_None);
    }
    if (out != NULL && out != stack_out) PyMem_Free(out);
    return result;
}

static PyMethodDef methods[] = {
    {"event", (PyCFunction)(void (*)(void))event, METH_FASTCALL,
     "event(data, client_ids, limit) -> (framed, k) | None: one common engine read relayed (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastevent",
    "The relay step of one common engine read, in C; core/relay.py is the reference.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastevent(void) { return PyModule_Create(&module); }
