/* narwhal.http._fasthead: the scan of a common HTTP/1.1 request head, in C (issue 25).

   head(data, head_max) -> (method, target, fields, length) | None

   The same answer as the Python scan in narwhal/http/h1/head.py (`scan`), which stays the
   reference: given the bytes at the start of a connection's receive buffer, it answers
   only for a whole head within head_max bytes (its blank line included) of the common
   shape, and declines (None) for anything else, which the general reader
   (narwhal/http/h1/parse.py) then reads. The common shape, each rule the Python scan's:

     * no LF in the head but as the end of a CRLF (the general reader takes a bare LF as a
       line's end);
     * the request line `METHOD SP TARGET SP HTTP/1.1`, METHOD `POST` or `GET`, TARGET one
       or more visible ASCII bytes (0x21-0x7E);
     * one or more field lines, each `token ":" rest CRLF` where rest is only space, tab,
       visible ASCII and obs-text (0x80-0xFF) -- RFC 9110's OWS field-value OWS, a subset
       of what the general reader takes (it takes controls too);
     * no Transfer-Encoding; a Content-Length at most once, of 1-20 ASCII digits.

   `fields` are (name as sent, name in lower case, value without its outer blanks) as
   narwhal/http/h1 keeps them; `length` is the head's byte count with its blank line.
   Making the Request (and its Host checks) is left to the caller.

   Sans-IO: no socket, no Python object but the arguments and the result. */

#define _GNU_SOURCE /* memmem */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define CL_DIGITS 20 /* parse.CL_DIGITS */

/* RFC 9110 tchar */
static int is_tchar(unsigned char c) {
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return 1;
    return c != 0 && strchr("-!#$%&'*+.^_`|~", c) != NULL;
}

/* a byte of a field line after its colon: space, tab, visible ASCII, obs-text */
static inline int is_rest(unsigned char c) { return c == ' ' || c == '\t' || (c >= 0x21 && c != 0x7F); }

static int eq_lower(const unsigned char *p, Py_ssize_t n, const char *lower) {
    if ((Py_ssize_t)strlen(lower) != n) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = p[i];
        if (c >= 'A' && c <= 'Z') c = (unsigned char)(c + 32);
        if (c != (unsigned char)lower[i]) return 0;
    }
    return 1;
}

/* the fields of the head d[first:stop] (stop: the blank line's CRLF), or NULL with no
   error set: decline; NULL with an error set: a failure */
static PyObject *fields_of(const unsigned char *d, Py_ssize_t first, Py_ssize_t stop) {
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    int seen_length = 0;
    Py_ssize_t i = first;
    while (i < stop) {
        Py_ssize_t name_start = i;
        while (i < stop && is_tchar(d[i])) i++;
        if (i == name_start || i >= stop || d[i] != ':') goto decline;
        Py_ssize_t name_end = i++;
        Py_ssize_t v = i;
        while (i < stop && d[i] != '\r') {
            if (!is_rest(d[i])) goto decline;
            i++;
        }
        /* i < stop: a CR; the head's rule (no bare LF, checked before) makes it a CRLF */
        if (i >= stop || d[i + 1] != '\n') goto decline;
        Py_ssize_t line_end = i;
        i += 2;
        Py_ssize_t ve = line_end;
        while (v < ve && (d[v] == ' ' || d[v] == '\t')) v++;
        while (ve > v && (d[ve - 1] == ' ' || d[ve - 1] == '\t')) ve--;
        const unsigned char *name = d + name_start;
        Py_ssize_t nlen = name_end - name_start;
        if (eq_lower(name, nlen, "content-length")) {
            if (seen_length || ve == v || ve - v > CL_DIGITS) goto decline;
            for (Py_ssize_t k = v; k < ve; k++)
                if (d[k] < '0' || d[k] > '9') goto decline;
            seen_length = 1;
        } else if (eq_lower(name, nlen, "transfer-encoding")) {
            goto decline;
        }
        PyObject *raw = PyBytes_FromStringAndSize((const char *)name, nlen);
        PyObject *lower = PyBytes_FromStringAndSize(NULL, nlen);
        PyObject *value = PyBytes_FromStringAndSize((const char *)d + v, ve - v);
        if (raw == NULL || lower == NULL || value == NULL) {
            Py_XDECREF(raw);
            Py_XDECREF(lower);
            Py_XDECREF(value);
            Py_DECREF(list);
            return NULL;
        }
        char *lo = PyBytes_AS_STRING(lower);
        for (Py_ssize_t k = 0; k < nlen; k++) {
            unsigned char c = name[k];
            lo[k] = (char)((c >= 'A' && c <= 'Z') ? c + 32 : c);
        }
        PyObject *t = PyTuple_Pack(3, raw, lower, value);
        Py_DECREF(raw);
        Py_DECREF(lower);
        Py_DECREF(value);
        if (t == NULL || PyList_Append(list, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(t);
    }
    if (PyList_GET_SIZE(list) == 0) goto decline; /* no field line: the general reader's */
    return list;
decline:
    Py_DECREF(list);
    return NULL;
}

static PyObject *head(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "head(data, head_max)");
        return NULL;
    }
    Py_ssize_t head_max = PyLong_AsSsize_t(args[1]);
    if (head_max == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *d = (const unsigned char *)view.buf;
    Py_ssize_t lim = view.len < head_max ? view.len : head_max;
    PyObject *result = NULL;
    const unsigned char *at = lim >= 4 ? memmem(d, (size_t)lim, "\r\n\r\n", 4) : NULL;
    if (at == NULL) goto none;
    Py_ssize_t end = at - d; /* the blank line's CRLF is at end + 2 */
    Py_ssize_t length = end + 4;
    for (const unsigned char *p = memchr(d, '\n', (size_t)length); p != NULL;
         p = memchr(p + 1, '\n', (size_t)(d + length - p - 1))) {
        if (p == d || p[-1] != '\r') goto none; /* a bare LF */
    }
    /* the request line: d[0:line_end] */
    const unsigned char *cr = memmem(d, (size_t)length, "\r\n", 2);
    Py_ssize_t line_end = cr - d;
    if (line_end == end) goto none; /* no field line */
    const unsigned char *sp1 = memchr(d, ' ', (size_t)line_end);
    if (sp1 == NULL) goto none;
    Py_ssize_t mlen = sp1 - d;
    if (!((mlen == 4 && memcmp(d, "POST", 4) == 0) || (mlen == 3 && memcmp(d, "GET", 3) == 0))) goto none;
    const unsigned char *t0 = sp1 + 1;
    const unsigned char *sp2 = memchr(t0, ' ', (size_t)(d + line_end - t0));
    if (sp2 == NULL || sp2 == t0) goto none;
    for (const unsigned char *p = t0; p < sp2; p++)
        if (*p < 0x21 || *p > 0x7E) goto none;
    if (d + line_end - (sp2 + 1) != 8 || memcmp(sp2 + 1, "HTTP/1.1", 8) != 0) goto none;
    PyObject *fields = fields_of(d, line_end + 2, end + 2);
    if (fields == NULL) {
        if (PyErr_Occurred()) goto out;
        goto none;
    }
    result = Py_BuildValue("(y#y#Nn)", (const char *)d, mlen, (const char *)t0, (Py_ssize_t)(sp2 - t0), fields, length);
    goto out;
none:
    result = Py_NewRef(Py_None);
out:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"head", (PyCFunction)(void (*)(void))head, METH_FASTCALL,
     "head(data, head_max) -> (method, target, fields, length) | None: a common request head scanned (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fasthead",
    "The scan of a common HTTP/1.1 request head, in C; narwhal/http/h1/head.py's scan is the reference.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fasthead(void) { return PyModule_Create(&module); }
