// What a large payload costs to copy, and what it costs to register with the
// device instead (registering each message on the fly rather than copying it
// into registered memory; docs/benchmarks.md, "Copy or register on the fly").
// For 256 KiB, 1 MiB and 16 MiB: memcpy into a warm buffer; ibv_reg_mr +
// ibv_dereg_mr of a warm buffer (the price of registering each message on the
// fly); and both on fresh memory. Uses the first RDMA device in the list.
// Usage, from the repository root (the VM shares it):
//   gcc -O2 -o target/copy-vs-register scripts/copy-vs-register.c -libverbs
//   ../shared/softroce/run-in-softroce-vm.sh target/copy-vs-register   # Soft-RoCE
//   target/copy-vs-register                                            # a host with a device
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
int main(void) {
  int n;
  struct ibv_device **l = ibv_get_device_list(&n);
  if (!l || n == 0) { fprintf(stderr, "no RDMA device\n"); return 1; }
  struct ibv_context *ctx = ibv_open_device(l[0]);
  struct ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : NULL;
  if (!pd) { fprintf(stderr, "cannot open %s\n", ibv_get_device_name(l[0])); return 1; }
  printf("device %s\n", ibv_get_device_name(l[0]));
  size_t sizes[] = {256 << 10, 1 << 20, 16 << 20};
  for (int s = 0; s < 3; s++) {
    size_t len = sizes[s];
    int reps = len >= (16 << 20) ? 5 : 40;
    char *src = aligned_alloc(4096, len), *dst = aligned_alloc(4096, len);
    memset(src, 1, len); memset(dst, 2, len);
    double a = now();
    for (int i = 0; i < reps; i++) { src[i] = (char)i; memcpy(dst, src, len); }
    double copy = (now() - a) / reps;
    a = now();
    for (int i = 0; i < reps; i++) {
      struct ibv_mr *mr = ibv_reg_mr(pd, src, len, IBV_ACCESS_LOCAL_WRITE);
      if (!mr) { perror("ibv_reg_mr"); return 1; }
      if (ibv_dereg_mr(mr)) { perror("ibv_dereg_mr"); return 1; }
    }
    double reg = (now() - a) / reps;
    // Fresh memory each time: what a new message's buffer costs either way.
    a = now();
    for (int i = 0; i < reps; i++) {
      char *f = malloc(len); memset(f, 3, len); memcpy(dst, f, len); free(f);
    }
    double fresh_copy = (now() - a) / reps;
    a = now();
    for (int i = 0; i < reps; i++) {
      char *f = malloc(len); memset(f, 3, len);
      struct ibv_mr *mr = ibv_reg_mr(pd, f, len, IBV_ACCESS_LOCAL_WRITE);
      if (!mr) { perror("ibv_reg_mr"); return 1; }
      ibv_dereg_mr(mr); free(f);
    }
    double fresh_reg = (now() - a) / reps;
    printf("%6zu KiB: memcpy %8.0f us (%6.0f MB/s) | reg+dereg %8.0f us | fresh: memset+memcpy %8.0f us, memset+reg+dereg %8.0f us\n",
           len >> 10, copy * 1e6, len / copy / 1e6, reg * 1e6, fresh_copy * 1e6, fresh_reg * 1e6);
    free(src); free(dst);
  }
  return 0;
}
