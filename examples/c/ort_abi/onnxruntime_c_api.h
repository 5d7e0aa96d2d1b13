/* NOT ONNX Runtime's header. A subset of the ONNX Runtime C API's declarations, written for
 * this repository from the API's ABI (the slot order of `struct OrtApi`, which ONNX Runtime
 * only ever appends to), so that CI can build examples/c/train.c without the ONNX Runtime
 * SDK: the PyPI wheel ships libonnxruntime.so but no header. It declares exactly what
 * train.c calls; the other slots are padding. With the SDK, compile against its own
 * include/ directory instead (-I <onnxruntime>/include): train.c needs no change.
 *
 * ORT_API_VERSION is 17 (ONNX Runtime 1.17, the oldest the trainops library supports):
 * GetApi(17) is served by every runtime from 1.17 on. */
#ifndef TRAINOPS_ORT_ABI_SUBSET_H
#define TRAINOPS_ORT_ABI_SUBSET_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ORT_API_VERSION 17

#ifdef _WIN32
#define ORT_API_CALL __stdcall
typedef wchar_t ORTCHAR_T;
#else
#define ORT_API_CALL
typedef char ORTCHAR_T;
#endif

typedef struct OrtEnv OrtEnv;
typedef struct OrtStatus OrtStatus;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtSession OrtSession;
typedef struct OrtMemoryInfo OrtMemoryInfo;
typedef struct OrtValue OrtValue;
typedef struct OrtIoBinding OrtIoBinding;
typedef struct OrtRunOptions OrtRunOptions;

typedef enum OrtLoggingLevel {
  ORT_LOGGING_LEVEL_VERBOSE, ORT_LOGGING_LEVEL_INFO, ORT_LOGGING_LEVEL_WARNING,
  ORT_LOGGING_LEVEL_ERROR, ORT_LOGGING_LEVEL_FATAL
} OrtLoggingLevel;

typedef enum OrtAllocatorType {
  OrtInvalidAllocator = -1, OrtDeviceAllocator = 0, OrtArenaAllocator = 1
} OrtAllocatorType;

typedef enum OrtMemType {
  OrtMemTypeCPUInput = -2, OrtMemTypeCPUOutput = -1, OrtMemTypeCPU = OrtMemTypeCPUOutput,
  OrtMemTypeDefault = 0
} OrtMemType;

typedef enum ONNXTensorElementDataType {
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING, ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_COMPLEX64, ONNX_TENSOR_ELEMENT_DATA_TYPE_COMPLEX128,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16
} ONNXTensorElementDataType;

/* Slots 0..228 of struct OrtApi; _padN fills the slots train.c does not call. */
typedef struct OrtApi {
  OrtStatus*(ORT_API_CALL* CreateStatus)(int code, const char* msg);                 /* 0 */
  int(ORT_API_CALL* GetErrorCode)(const OrtStatus* status);                          /* 1 */
  const char*(ORT_API_CALL* GetErrorMessage)(const OrtStatus* status);               /* 2 */
  OrtStatus*(ORT_API_CALL* CreateEnv)(OrtLoggingLevel log_severity_level, const char* logid,
                                      OrtEnv** out);                                 /* 3 */
  void* _pad4[3];                                                                    /* 4-6 */
  OrtStatus*(ORT_API_CALL* CreateSession)(const OrtEnv* env, const ORTCHAR_T* model_path,
                                          const OrtSessionOptions* options,
                                          OrtSession** out);                         /* 7 */
  void* _pad8[2];                                                                    /* 8-9 */
  OrtStatus*(ORT_API_CALL* CreateSessionOptions)(OrtSessionOptions** options);       /* 10 */
  void* _pad11[11];                                                                  /* 11-21 */
  OrtStatus*(ORT_API_CALL* SetSessionLogSeverityLevel)(OrtSessionOptions* options,
                                                       int session_log_severity_level); /* 22 */
  void* _pad23[1];                                                                   /* 23 */
  OrtStatus*(ORT_API_CALL* SetIntraOpNumThreads)(OrtSessionOptions* options,
                                                 int intra_op_num_threads);          /* 24 */
  OrtStatus*(ORT_API_CALL* SetInterOpNumThreads)(OrtSessionOptions* options,
                                                 int inter_op_num_threads);          /* 25 */
  void* _pad26[23];                                                                  /* 26-48 */
  OrtStatus*(ORT_API_CALL* CreateTensorWithDataAsOrtValue)(
      const OrtMemoryInfo* info, void* p_data, size_t p_data_len, const int64_t* shape,
      size_t shape_len, ONNXTensorElementDataType type, OrtValue** out);             /* 49 */
  void* _pad50[1];                                                                   /* 50 */
  OrtStatus*(ORT_API_CALL* GetTensorMutableData)(OrtValue* value, void** out);      /* 51 */
  void* _pad52[17];                                                                  /* 52-68 */
  OrtStatus*(ORT_API_CALL* CreateCpuMemoryInfo)(OrtAllocatorType type, OrtMemType mem_type,
                                                OrtMemoryInfo** out);                /* 69 */
  void* _pad70[22];                                                                  /* 70-91 */
  void(ORT_API_CALL* ReleaseEnv)(OrtEnv* input);                                     /* 92 */
  void(ORT_API_CALL* ReleaseStatus)(OrtStatus* input);                               /* 93 */
  void(ORT_API_CALL* ReleaseMemoryInfo)(OrtMemoryInfo* input);                       /* 94 */
  void(ORT_API_CALL* ReleaseSession)(OrtSession* input);                             /* 95 */
  void(ORT_API_CALL* ReleaseValue)(OrtValue* input);                                 /* 96 */
  void* _pad97[3];                                                                   /* 97-99 */
  void(ORT_API_CALL* ReleaseSessionOptions)(OrtSessionOptions* input);               /* 100 */
  void* _pad101[32];                                                                 /* 101-132 */
  OrtStatus*(ORT_API_CALL* RunWithBinding)(OrtSession* session,
                                           const OrtRunOptions* run_options,
                                           const OrtIoBinding* binding_ptr);         /* 133 */
  OrtStatus*(ORT_API_CALL* CreateIoBinding)(OrtSession* session, OrtIoBinding** out); /* 134 */
  void(ORT_API_CALL* ReleaseIoBinding)(OrtIoBinding* input);                         /* 135 */
  OrtStatus*(ORT_API_CALL* BindInput)(OrtIoBinding* binding_ptr, const char* name,
                                      const OrtValue* val_ptr);                      /* 136 */
  OrtStatus*(ORT_API_CALL* BindOutput)(OrtIoBinding* binding_ptr, const char* name,
                                       const OrtValue* val_ptr);                     /* 137 */
  void* _pad138[90];                                                                 /* 138-227 */
  OrtStatus*(ORT_API_CALL* RegisterCustomOpsLibrary_V2)(OrtSessionOptions* options,
                                                        const ORTCHAR_T* library_name); /* 228 */
} OrtApi;

typedef struct OrtApiBase {
  const OrtApi*(ORT_API_CALL* GetApi)(uint32_t version);
  const char*(ORT_API_CALL* GetVersionString)(void);
} OrtApiBase;

const OrtApiBase* ORT_API_CALL OrtGetApiBase(void);

#ifdef __cplusplus
}
#endif

#endif /* TRAINOPS_ORT_ABI_SUBSET_H */
