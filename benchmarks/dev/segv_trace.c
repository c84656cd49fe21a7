// LD_PRELOAD this (gcc -shared -fPIC -o segv_trace.so segv_trace.c) to print the native stack of a SIGSEGV
// or SIGABRT (Python's faulthandler shows only Python frames); the frames resolve with addr2line against the
// listed objects (build with -g for lines). The handler runs on its own stack, so a stack overflow prints too.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int sig, siginfo_t* info, void* ctx) {
  (void)info, (void)ctx;
  void* frames[128];
  const int n = backtrace(frames, 128);
  const char* msg = sig == SIGSEGV ? "\n== SIGSEGV, native stack:\n" : "\n== SIGABRT, native stack:\n";
  write(2, msg, strlen(msg));
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((visibility("default"))) void segv_trace_install(void) {
  static char* alt = 0;
  if (!alt) {
    alt = malloc(1 << 16);
    stack_t ss = {.ss_sp = alt, .ss_size = 1 << 16, .ss_flags = 0};
    sigaltstack(&ss, 0);
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGABRT, &sa, 0);
}

__attribute__((constructor)) static void install(void) { segv_trace_install(); }
