/* Training from trainops artifacts with ONNX Runtime's C API alone (docs/languages/c.md).
 *
 *   train ARTIFACTS_DIR LIBTRAINOPS BATCHES.safetensors STEPS [OUT.safetensors]
 *
 * Reads manifest.json and checkpoint.safetensors, binds every state's input AND output to
 * one buffer (IOBinding: the session updates it in place), then runs STEPS steps on the
 * batches of BATCHES.safetensors (tensors "<step>/<data input>", step from 0), printing each
 * step's loss (%.9g for float32, %.17g for float64). With OUT, writes the checkpoint after
 * the last step (the states, the checkpoint's other tensors, the metadata updated).
 *
 * Build: gcc -O2 -std=c11 train.c -I <onnxruntime>/include -L <dir of libonnxruntime.so>
 *        -lonnxruntime -o train      (or -I ort_abi: the declarations it uses, no SDK) */
#define _XOPEN_SOURCE 700 /* realpath, fsync (POSIX) */
#include <onnxruntime_c_api.h>

#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mini_json.h"

static const OrtApi* ort;

static void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("train: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

/* Every ONNX Runtime call: an error status ends the program with its message. */
#define CHECK(expr)                                                        \
  do {                                                                     \
    OrtStatus* status_ = (expr);                                           \
    if (status_) die("%s: %s", #expr, ort->GetErrorMessage(status_));      \
  } while (0)

static char* read_file(const char* path, size_t* len) {
  FILE* f = fopen(path, "rb");
  if (!f) die("cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char* data = malloc((size_t)n + 1);
  if (fread(data, 1, (size_t)n, f) != (size_t)n) die("cannot read %s", path);
  fclose(f);
  data[n] = 0;
  *len = (size_t)n;
  return data;
}

static char* join(const char* dir, const char* name) {
  char* p = malloc(strlen(dir) + strlen(name) + 2);
  sprintf(p, "%s/%s", dir, name);
  return p;
}

/* --- dtypes: the manifest's numpy names, safetensors' names, ONNX element types ------- */
typedef struct {
  const char* numpy;
  const char* safetensors;
  ONNXTensorElementDataType onnx;
  size_t size;
} dtype_info;

static const dtype_info DTYPES[] = {
    {"float32", "F32", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, 4},
    {"float64", "F64", ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE, 8},
    {"float16", "F16", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, 2},
    {"bfloat16", "BF16", ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16, 2},
    {"int64", "I64", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, 8},
    {"int32", "I32", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, 4},
    {"uint64", "U64", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64, 8},
    {"uint32", "U32", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32, 4},
    {"bool", "BOOL", ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, 1},
    {"int8", "I8", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8, 1},
    {"uint8", "U8", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, 1},
};

static const dtype_info* dtype(const char* name, bool safetensors_name) {
  for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++)
    if (name && !strcmp(safetensors_name ? DTYPES[i].safetensors : DTYPES[i].numpy, name))
      return &DTYPES[i];
  die("unsupported dtype %s", name ? name : "(none)");
  return NULL;
}

/* --- safetensors: u64 little-endian header length, JSON header, the bytes ------------- */
typedef struct {
  char* file;
  size_t len;
  json header;
  const char* bytes; /* start of the data: offsets are relative to it */
} safetensors;

typedef struct {
  const dtype_info* dtype;
  int64_t shape[16];
  size_t ndim, count;
  const char* data;
  size_t nbytes;
} tensor_view;

static void st_open(safetensors* f, const char* path) {
  f->file = read_file(path, &f->len);
  if (f->len < 8) die("%s: not a safetensors file", path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = n << 8 | (unsigned char)f->file[i];
  if (n > f->len - 8 || json_parse(f->file + 8, (size_t)n, &f->header) ||
      f->header.type != JSON_OBJECT)
    die("%s: bad safetensors header", path);
  f->bytes = f->file + 8 + n;
}

/* Tensor `name` of `f`: false when absent. */
static bool st_get(const safetensors* f, const char* name, tensor_view* t) {
  const json* e = json_get(&f->header, name);
  if (!e) return false;
  const json* shape = json_get(e, "shape");
  const json* off = json_get(e, "data_offsets");
  t->dtype = dtype(json_str(e, "dtype"), true);
  t->ndim = shape->n;
  t->count = 1;
  for (size_t i = 0; i < shape->n; i++) t->count *= (size_t)(t->shape[i] = (int64_t)shape->items[i].number);
  t->data = f->bytes + (size_t)off->items[0].number;
  t->nbytes = (size_t)(off->items[1].number - off->items[0].number);
  if (t->nbytes != t->count * t->dtype->size) die("tensor %s: %zu bytes for %zu elements", name, t->nbytes, t->count);
  return true;
}

static const char* st_meta(const safetensors* f, const char* key) {
  return json_str(json_get(&f->header, "__metadata__"), key);
}

/* --- OrtValues over our own buffers --------------------------------------------------- */
static OrtMemoryInfo* cpu;

static OrtValue* value_over(void* data, size_t nbytes, const int64_t* shape, size_t ndim,
                            ONNXTensorElementDataType type) {
  OrtValue* v = NULL;
  CHECK(ort->CreateTensorWithDataAsOrtValue(cpu, data, nbytes, shape, ndim, type, &v));
  return v;
}

/* A zeroed buffer of the manifest entry `e` ({"dtype", "shape"}) and its OrtValue. */
static OrtValue* zeroed(const json* e, void** data) {
  const dtype_info* d = dtype(json_str(e, "dtype"), false);
  const json* shape = json_get(e, "shape");
  int64_t dims[16];
  size_t count = 1;
  for (size_t i = 0; i < shape->n; i++) count *= (size_t)(dims[i] = (int64_t)shape->items[i].number);
  *data = calloc(count ? count : 1, d->size);
  return value_over(*data, count * d->size, dims, shape->n, d->onnx);
}

/* --- the checkpoint writer ------------------------------------------------------------ */
typedef struct { char* s; size_t n, cap; } text;

static void put(text* t, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (t->n + (size_t)k + 1 > t->cap) {
    t->cap = 2 * (t->n + (size_t)k + 1);
    t->s = realloc(t->s, t->cap);
  }
  va_start(ap, fmt);
  vsnprintf(t->s + t->n, (size_t)k + 1, fmt, ap);
  va_end(ap);
  t->n += (size_t)k;
}

static void put_string(text* t, const char* s) {
  put(t, "\"");
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') put(t, "\\%c", *s);
    else if ((unsigned char)*s < 0x20) put(t, "\\u%04x", (unsigned char)*s);
    else put(t, "%c", *s);
  }
  put(t, "\"");
}

/* `x` as Python's repr(float) writes it (the metadata's float format). */
static void py_repr(double x, char* out) {
  if (isnan(x)) { strcpy(out, "nan"); return; }
  if (isinf(x)) { strcpy(out, x < 0 ? "-inf" : "inf"); return; }
  char e[40], digits[24];
  int p = 1;
  for (; p < 17; p++) {  /* the shortest digits that read back as x */
    snprintf(e, sizeof e, "%.*e", p - 1, x);
    if (strtod(e, NULL) == x) break;
  }
  snprintf(e, sizeof e, "%.*e", p - 1, x);
  const char* m = e + (e[0] == '-');
  size_t nd = 0;
  for (; *m && *m != 'e'; m++)
    if (*m != '.') digits[nd++] = *m;
  digits[nd] = 0;
  int exp10 = atoi(m + 1);
  char* o = out;
  if (x < 0) *o++ = '-';
  if (exp10 >= -4 && exp10 < 16) { /* Python: positional when -4 <= exponent < 16 */
    if (exp10 >= 0) {
      for (int i = 0; i <= exp10; i++) *o++ = i < (int)nd ? digits[i] : '0';
      *o++ = '.';
      if ((int)nd > exp10 + 1) { strcpy(o, digits + exp10 + 1); o += nd - (size_t)exp10 - 1; }
      else *o++ = '0';
    } else {
      *o++ = '0'; *o++ = '.';
      for (int i = 0; i < -exp10 - 1; i++) *o++ = '0';
      strcpy(o, digits); o += nd;
    }
    *o = 0;
  } else {
    *o++ = digits[0];
    if (nd > 1) { *o++ = '.'; strcpy(o, digits + 1); o += nd - 1; }
    sprintf(o, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
  }
}

typedef struct { const char* name; const dtype_info* dtype; const json* shape; const void* data; size_t nbytes; } out_tensor;

/* Writes `tensors` and `ckpt`'s metadata with step, skipped and loss_scale replaced, as a
 * safetensors file at `path`, atomically (docs/artifacts.md, "Writing"): through a symlink
 * to the file it names, never over a directory, FIFO or device (a rename would replace the
 * node), into a temporary file fsync'ed and renamed over it; on failure the previous file
 * stays and the temporary file is removed. */
static void write_checkpoint(const char* path, const safetensors* ckpt, const out_tensor* tensors,
                             size_t n, long long step, long long skipped, const char* loss_scale) {
  text h = {0};
  put(&h, "{\"__metadata__\":{");
  const json* meta = json_get(&ckpt->header, "__metadata__");
  for (size_t i = 0; i < meta->n; i++) {
    const char* k = meta->keys[i];
    char buf[64];
    const char* v = meta->items[i].text;
    if (!strcmp(k, "step")) { snprintf(buf, sizeof buf, "%lld", step); v = buf; }
    else if (!strcmp(k, "skipped")) { snprintf(buf, sizeof buf, "%lld", skipped); v = buf; }
    else if (!strcmp(k, "loss_scale") && loss_scale) v = loss_scale;
    put(&h, i ? "," : "");
    put_string(&h, k);
    put(&h, ":");
    put_string(&h, v);
  }
  put(&h, "}");
  size_t offset = 0;
  for (size_t i = 0; i < n; i++) {
    put(&h, ",");
    put_string(&h, tensors[i].name);
    put(&h, ":{\"dtype\":\"%s\",\"shape\":[", tensors[i].dtype->safetensors);
    for (size_t d = 0; d < tensors[i].shape->n; d++)
      put(&h, "%s%s", d ? "," : "", tensors[i].shape->items[d].text);
    put(&h, "],\"data_offsets\":[%zu,%zu]}", offset, offset + tensors[i].nbytes);
    offset += tensors[i].nbytes;
  }
  put(&h, "}");
  while (h.n % 8) put(&h, " ");
  struct stat st;
  char* target = realpath(path, NULL); /* NULL when it does not exist yet */
  if (target && (stat(target, &st) || !S_ISREG(st.st_mode)))
    die("cannot write %s: %s is not a regular file", path, target);
  if (!target) target = strdup(path);
  char* tmp = malloc(strlen(target) + 5);
  sprintf(tmp, "%s.tmp", target);
  FILE* f = fopen(tmp, "wb");
  if (!f) die("cannot write %s", tmp);
  unsigned char len[8];
  for (int i = 0; i < 8; i++) len[i] = (unsigned char)((uint64_t)h.n >> (8 * i));
  fwrite(len, 1, 8, f);
  fwrite(h.s, 1, h.n, f);
  for (size_t i = 0; i < n; i++) fwrite(tensors[i].data, 1, tensors[i].nbytes, f);
  bool ok = !ferror(f) && !fflush(f) && !fsync(fileno(f));
  if (fclose(f) || !ok || rename(tmp, target)) {
    remove(tmp);
    die("cannot write %s (a full disk, a file-size limit?): the previous file is unchanged", path);
  }
  free(tmp);
  free(target);
  free(h.s);
}

int main(int argc, char** argv) {
  if (argc < 5) die("usage: train ARTIFACTS_DIR LIBTRAINOPS BATCHES.safetensors STEPS [OUT.safetensors]");
  const char *dir = argv[1], *library = argv[2], *batches_path = argv[3], *out_path = argc > 5 ? argv[5] : NULL;
  long steps = strtol(argv[4], NULL, 10);

  /* 1. the manifest; the session on training.onnx with the trainops library registered */
  ort = OrtGetApiBase()->GetApi(ORT_API_VERSION);
  if (!ort) die("ONNX Runtime %s does not serve C API version %d", OrtGetApiBase()->GetVersionString(), ORT_API_VERSION);
  size_t len;
  char* path = join(dir, "manifest.json");
  char* text_ = read_file(path, &len);
  json man;
  if (json_parse(text_, len, &man)) die("%s: bad JSON", path);
  const json* version = json_get(&man, "format_version");
  if (!json_str(&man, "format") || strcmp(json_str(&man, "format"), "trainops-artifacts") || !version || version->number != 1)
    die("%s: not a trainops artifacts manifest of format version 1", path);
  OrtEnv* env;
  OrtSessionOptions* so;
  OrtSession* session;
  CHECK(ort->CreateEnv(ORT_LOGGING_LEVEL_ERROR, "train", &env));
  CHECK(ort->CreateSessionOptions(&so));
  CHECK(ort->SetIntraOpNumThreads(so, 1));
  CHECK(ort->SetInterOpNumThreads(so, 1));
  CHECK(ort->RegisterCustomOpsLibrary_V2(so, library));
  char* model = join(dir, json_str(json_get(&man, "models"), "training"));
  CHECK(ort->CreateSession(env, model, so, &session));
  CHECK(ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &cpu));
  OrtIoBinding* binding;
  CHECK(ort->CreateIoBinding(session, &binding));

  /* 2. every state from the checkpoint: ONE buffer bound as its input and its output */
  safetensors ckpt;
  char* ckpt_path = join(dir, json_str(&man, "checkpoint"));
  st_open(&ckpt, ckpt_path);
  const json* states = json_get(&man, "states");
  void** buffers = calloc(states->n, sizeof(void*));
  OrtValue** values = calloc(states->n, sizeof(OrtValue*));
  const char* loss_scale_state = NULL;
  void* loss_scale_buffer = NULL;
  for (size_t i = 0; i < states->n; i++) {
    const json* s = &states->items[i];
    tensor_view t;
    const char* name = json_str(s, "input");
    if (!st_get(&ckpt, name, &t)) die("checkpoint: no tensor %s", name);
    if (t.dtype != dtype(json_str(s, "dtype"), false) || t.ndim != json_get(s, "shape")->n)
      die("checkpoint: tensor %s is not %s of the manifest's shape", name, json_str(s, "dtype"));
    buffers[i] = malloc(t.nbytes ? t.nbytes : 1);
    memcpy(buffers[i], t.data, t.nbytes);
    values[i] = value_over(buffers[i], t.nbytes, t.shape, t.ndim, t.dtype->onnx);
    CHECK(ort->BindInput(binding, name, values[i]));
    CHECK(ort->BindOutput(binding, json_str(s, "output"), values[i]));
    if (json_str(s, "slot") && !strcmp(json_str(s, "kind"), "loss_scale") && !strcmp(json_str(s, "slot"), "scale")) {
      loss_scale_state = name;
      loss_scale_buffer = buffers[i];
    }
  }

  /* the loss and the extra outputs, into buffers of their own */
  const json* loss = json_get(&man, "loss");
  void* loss_buffer;
  OrtValue* loss_value = zeroed(loss, &loss_buffer);
  CHECK(ort->BindOutput(binding, json_str(loss, "training_output"), loss_value));
  const json* extras = json_get(&man, "extra_outputs");
  void** extra_buffers = calloc(extras->n + 1, sizeof(void*));
  OrtValue** extra_values = calloc(extras->n + 1, sizeof(OrtValue*));
  const char* skip_name = json_str(json_get(&man, "step"), "skip_output");
  const bool* skip_flag = NULL;
  for (size_t i = 0; i < extras->n; i++) {
    extra_values[i] = zeroed(&extras->items[i], &extra_buffers[i]);
    const char* name = json_str(&extras->items[i], "name");
    CHECK(ort->BindOutput(binding, name, extra_values[i]));
    if (skip_name && !strcmp(name, skip_name)) skip_flag = extra_buffers[i];
  }
  if (skip_name && !skip_flag) die("manifest: skip_output %s is no extra output", skip_name);

  /* the learning rate and T: [1]-shaped buffers bound once, written before each step */
  const json* lr_entry = json_get(&man, "learning_rate");
  const dtype_info* lr_dtype = dtype(json_str(lr_entry, "dtype"), false);
  double lr = strtod(st_meta(&ckpt, "learning_rate"), NULL);
  long long T = strtoll(st_meta(&ckpt, "step"), NULL, 10), skipped = strtoll(st_meta(&ckpt, "skipped"), NULL, 10);
  union { float f; double d; } lr_buffer;
  int64_t t_buffer[1];
  const int64_t one[1] = {1};
  if (lr_dtype->onnx == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) lr_buffer.f = (float)lr; else lr_buffer.d = lr;
  OrtValue* lr_value = value_over(&lr_buffer, lr_dtype->size, one, 1, lr_dtype->onnx);
  OrtValue* t_value = value_over(t_buffer, sizeof t_buffer, one, 1, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
  CHECK(ort->BindInput(binding, json_str(lr_entry, "input"), lr_value));
  CHECK(ort->BindInput(binding, json_str(json_get(&man, "step"), "input"), t_value));

  /* 3. the steps */
  safetensors batches;
  st_open(&batches, batches_path);
  const json* data = json_get(&man, "data_inputs");
  OrtValue** feeds = calloc(data->n + 1, sizeof(OrtValue*));
  void** feed_buffers = calloc(data->n + 1, sizeof(void*));
  const bool float32_loss = dtype(json_str(loss, "dtype"), false)->onnx == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  for (long k = 0; k < steps; k++) {
    for (size_t i = 0; i < data->n; i++) {
      char key[512];
      tensor_view t;
      snprintf(key, sizeof key, "%ld/%s", k, json_str(&data->items[i], "name"));
      if (!st_get(&batches, key, &t)) die("batches: no tensor %s", key);
      if (t.dtype != dtype(json_str(&data->items[i], "dtype"), false)) die("batches: %s has the wrong dtype", key);
      feed_buffers[i] = malloc(t.nbytes ? t.nbytes : 1); /* aligned, unlike the file's bytes */
      memcpy(feed_buffers[i], t.data, t.nbytes);
      feeds[i] = value_over(feed_buffers[i], t.nbytes, t.shape, t.ndim, t.dtype->onnx);
      CHECK(ort->BindInput(binding, json_str(&data->items[i], "name"), feeds[i]));
    }
    t_buffer[0] = T;
    CHECK(ort->RunWithBinding(session, NULL, binding));
    if (float32_loss) printf("%.9g\n", (double)*(float*)loss_buffer);
    else printf("%.17g\n", *(double*)loss_buffer);
    if (!skip_flag || *skip_flag) T++;  /* a skipped step does not count */
    else skipped++;
    for (size_t i = 0; i < data->n; i++) {
      ort->ReleaseValue(feeds[i]);
      free(feed_buffers[i]);
    }
  }

  /* 4. the checkpoint: every state, then the checkpoint's other tensors (the model bytes) */
  if (out_path) {
    size_t n_other = ckpt.header.n;
    out_tensor* out = calloc(states->n + n_other, sizeof(out_tensor));
    size_t n = 0;
    for (size_t i = 0; i < states->n; i++) {
      const json* s = &states->items[i];
      tensor_view t;
      st_get(&ckpt, json_str(s, "input"), &t);
      out[n++] = (out_tensor){json_str(s, "input"), t.dtype, json_get(s, "shape"), buffers[i], t.nbytes};
    }
    for (size_t i = 0; i < ckpt.header.n; i++) {
      const char* name = ckpt.header.keys[i];
      bool is_state = !strcmp(name, "__metadata__");
      for (size_t j = 0; j < states->n && !is_state; j++) is_state = !strcmp(name, json_str(&states->items[j], "input"));
      tensor_view t;
      if (is_state || !st_get(&ckpt, name, &t)) continue;
      out[n++] = (out_tensor){name, t.dtype, json_get(&ckpt.header.items[i], "shape"), t.data, t.nbytes};
    }
    char scale[40];
    if (loss_scale_state) py_repr((double)*(float*)loss_scale_buffer, scale);
    write_checkpoint(out_path, &ckpt, out, n, T, skipped, loss_scale_state ? scale : NULL);
    free(out);
  }

  ort->ReleaseValue(lr_value);
  ort->ReleaseValue(t_value);
  ort->ReleaseValue(loss_value);
  for (size_t i = 0; i < extras->n; i++) { ort->ReleaseValue(extra_values[i]); free(extra_buffers[i]); }
  for (size_t i = 0; i < states->n; i++) { ort->ReleaseValue(values[i]); free(buffers[i]); }
  ort->ReleaseIoBinding(binding);
  ort->ReleaseMemoryInfo(cpu);
  ort->ReleaseSession(session);
  ort->ReleaseSessionOptions(so);
  ort->ReleaseEnv(env);
  json_free(&man);
  json_free(&ckpt.header);
  json_free(&batches.header);
  free(ckpt.file); free(batches.file); free(text_); free(path); free(model); free(ckpt_path);
  free(buffers); free(values); free(extra_buffers); free(extra_values); free(feeds); free(feed_buffers);
  free(loss_buffer);
  return 0;
}
