// LD_PRELOAD this (gcc -shared -fPIC -o segv_trace.so segv_trace.c) to print the native stack of a SIGSEGV
// or SIGABRT (Python's faulthandler shows only Python frames); the frames resolve with addr2line against the
// listed objects (build with -g for lines).
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char* msg = sig == SIGSEGV ? "\n== SIGSEGV, native stack:\n" : "\n== SIGABRT, native stack:\n";
  write(2, msg, strlen(msg));
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  signal(SIGSEGV, on_signal);
  signal(SIGABRT, on_signal);
}
