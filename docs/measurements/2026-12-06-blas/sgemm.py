import ctypes, time, os, sys
lib = ctypes.CDLL("libopenblas.so.0")
lib.openblas_get_corename.restype = ctypes.c_char_p
lib.openblas_get_config.restype = ctypes.c_char_p
print(os.environ.get("OPENBLAS_CORETYPE"), lib.openblas_get_corename(), lib.openblas_get_config())
n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
A = (ctypes.c_float * (n*n))(*([0.5]*(n*n)))
B = (ctypes.c_float * (n*n))(*([0.25]*(n*n)))
C = (ctypes.c_float * (n*n))()
f = lib.cblas_sgemm
f.argtypes = [ctypes.c_int]*6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
f(101,111,111,n,n,n,1.0,A,n,B,n,0.0,C,n)
t=time.time(); r=10
for _ in range(r): f(101,111,111,n,n,n,1.0,A,n,B,n,0.0,C,n)
dt=(time.time()-t)/r
print("GFLOP/s %.1f" % (2*n**3/dt/1e9))
