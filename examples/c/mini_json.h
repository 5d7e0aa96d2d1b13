/* A small JSON reader for train.c (manifest.json and safetensors headers): parses a whole
 * document into a tree. Objects keep their keys in order; numbers are doubles (with their
 * text, for int64 values past 2^53). Header-only: #include it in one .c file. */
#ifndef TRAINOPS_MINI_JSON_H
#define TRAINOPS_MINI_JSON_H

#include <stdlib.h>
#include <string.h>

typedef enum { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } json_type;

typedef struct json {
  json_type type;
  int boolean;
  double number;
  char* text;          /* JSON_STRING: the string; JSON_NUMBER: its digits */
  size_t n;            /* JSON_ARRAY / JSON_OBJECT: number of items */
  struct json* items;  /* the items (values) */
  char** keys;         /* JSON_OBJECT: the items' keys */
} json;

typedef struct { const char* p; const char* end; int error; } json_cursor;

static void json_ws(json_cursor* c) {
  while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

static char* json_string(json_cursor* c) {
  if (c->p >= c->end || *c->p != '"') { c->error = 1; return NULL; }
  c->p++;
  char* out = malloc((size_t)(c->end - c->p) + 1);
  size_t k = 0;
  while (c->p < c->end && *c->p != '"') {
    char ch = *c->p++;
    if (ch == '\\' && c->p < c->end) {
      char e = *c->p++;
      switch (e) {
        case 'n': ch = '\n'; break;
        case 't': ch = '\t'; break;
        case 'r': ch = '\r'; break;
        case 'b': ch = '\b'; break;
        case 'f': ch = '\f'; break;
        case 'u': {  /* \uXXXX (the Basic Multilingual Plane) as UTF-8 */
          unsigned v = 0;
          for (int i = 0; i < 4 && c->p < c->end; i++, c->p++) {
            char h = *c->p;
            v = v * 16 + (unsigned)(h <= '9' ? h - '0' : (h | 32) - 'a' + 10);
          }
          if (v < 0x80) { out[k++] = (char)v; }
          else if (v < 0x800) { out[k++] = (char)(0xC0 | v >> 6); out[k++] = (char)(0x80 | (v & 63)); }
          else { out[k++] = (char)(0xE0 | v >> 12); out[k++] = (char)(0x80 | ((v >> 6) & 63));
                 out[k++] = (char)(0x80 | (v & 63)); }
          continue;
        }
        default: ch = e;  /* \" \\ \/ */
      }
    }
    out[k++] = ch;
  }
  if (c->p >= c->end) { c->error = 1; free(out); return NULL; }
  c->p++;
  out[k] = 0;
  return out;
}

static void json_value(json_cursor* c, json* v);

static void json_push(json* v, size_t* cap) {
  if (v->n == *cap) {
    *cap = *cap ? 2 * *cap : 4;
    v->items = realloc(v->items, *cap * sizeof(json));
    if (v->type == JSON_OBJECT) v->keys = realloc(v->keys, *cap * sizeof(char*));
  }
}

static void json_value(json_cursor* c, json* v) {
  memset(v, 0, sizeof *v);
  json_ws(c);
  if (c->p >= c->end) { c->error = 1; return; }
  char ch = *c->p;
  if (ch == '{' || ch == '[') {
    char close = ch == '{' ? '}' : ']';
    size_t cap = 0;
    v->type = ch == '{' ? JSON_OBJECT : JSON_ARRAY;
    c->p++;
    json_ws(c);
    if (c->p < c->end && *c->p == close) { c->p++; return; }
    while (!c->error) {
      json_push(v, &cap);
      if (v->type == JSON_OBJECT) {
        json_ws(c);
        v->keys[v->n] = json_string(c);
        json_ws(c);
        if (c->error || c->p >= c->end || *c->p++ != ':') { c->error = 1; return; }
      }
      json_value(c, &v->items[v->n++]);
      json_ws(c);
      if (c->p < c->end && *c->p == ',') { c->p++; continue; }
      if (c->p < c->end && *c->p == close) { c->p++; return; }
      c->error = 1;
    }
  } else if (ch == '"') {
    v->type = JSON_STRING;
    v->text = json_string(c);
  } else if (!strncmp(c->p, "true", 4) || !strncmp(c->p, "false", 5)) {
    v->type = JSON_BOOL;
    v->boolean = ch == 't';
    c->p += v->boolean ? 4 : 5;
  } else if (!strncmp(c->p, "null", 4)) {
    v->type = JSON_NULL;
    c->p += 4;
  } else {
    const char* start = c->p;
    while (c->p < c->end && strchr("+-0123456789.eE", *c->p)) c->p++;
    if (c->p == start) { c->error = 1; return; }
    v->type = JSON_NUMBER;
    v->text = malloc((size_t)(c->p - start) + 1);
    memcpy(v->text, start, (size_t)(c->p - start));
    v->text[c->p - start] = 0;
    v->number = strtod(v->text, NULL);
  }
}

/* Parses text[0..len); returns 0 on success. */
static int json_parse(const char* text, size_t len, json* out) {
  json_cursor c = {text, text + len, 0};
  json_value(&c, out);
  return c.error;
}

static void json_free(json* v) {
  for (size_t i = 0; i < v->n; i++) {
    json_free(&v->items[i]);
    if (v->keys) free(v->keys[i]);
  }
  free(v->items);
  free(v->keys);
  free(v->text);
}

/* The member `key` of object `v`, or NULL. */
static const json* json_get(const json* v, const char* key) {
  if (!v || v->type != JSON_OBJECT) return NULL;
  for (size_t i = 0; i < v->n; i++)
    if (v->keys[i] && !strcmp(v->keys[i], key)) return &v->items[i];
  return NULL;
}

/* The string member `key` of `v`, or NULL (also when it is null or not a string). */
static const char* json_str(const json* v, const char* key) {
  const json* s = json_get(v, key);
  return s && s->type == JSON_STRING ? s->text : NULL;
}

#endif /* TRAINOPS_MINI_JSON_H */
