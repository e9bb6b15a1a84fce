// What a shared receive queue (wire protocol §4.7) needs from the device, checked on
// the device itself rather than assumed. One process, RC QPs connected to
// each other through the device's loopback (raw verbs, GID index
// $SOFTROCE_GID_INDEX), on $SOFTROCE_DEV (default rxe0). Every other device
// in the list (siw0 when the VM has it) gets the capability lines only:
// iWARP QPs cannot be connected without rdma_cm.
//
//   1. the capabilities: max_srq, max_mw, memory-window types;
//   2. one SRQ feeding two QPs: each SEND lands in an SRQ buffer and its
//      completion names the QP it came on (qp_num);
//   3. a QP in another protection domain than the SRQ's buffers: can it be
//      created, and can it receive into them?
//   4. a type-2 memory window bound to one QP over a region registered
//      without remote access: a WRITE through that QP lands; the same rkey
//      used on another QP of the same PD fails; the region's own rkey fails;
//      after the window is deallocated the WRITE fails;
//   5. a QP on the SRQ moved to the error state: flushed completions, and
//      the IBV_EVENT_QP_LAST_WQE_REACHED async event;
//   6. the cost: a 64 B SEND ping-pong, polled, through the QP's own receive
//      queue and through the SRQ.
//
// Results for rxe and siw: docs/architecture.md, "What the devices do, measured".
// Usage, from the repository root (the VM shares it):
//   gcc -O2 -o target/srq-mw-probe scripts/srq-mw-probe.c -libverbs
//   SOFTROCE_VM_SIW=1 ../shared/softroce/run-in-softroce-vm.sh target/srq-mw-probe
// On a machine with a real device, run target/srq-mw-probe directly with
// SOFTROCE_DEV and SOFTROCE_GID_INDEX set to its device and GID index.
#define _GNU_SOURCE
#include <errno.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DIE(...) do { fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } while (0)

static union ibv_gid gid;
static int gidx = 1;
static struct ibv_context *ctx;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Polls one completion from cq within 2 s; returns 0 and fills wc, or -1.
static int poll1(struct ibv_cq *cq, struct ibv_wc *wc) {
  double end = now() + 2.0;
  while (now() < end) {
    int r = ibv_poll_cq(cq, 1, wc);
    if (r < 0) DIE("ibv_poll_cq");
    if (r == 1) return 0;
  }
  return -1;
}

static void connect_qp(struct ibv_qp *qp, uint32_t dqpn) {
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
                          .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE};
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    DIE("INIT");
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTR; a.path_mtu = IBV_MTU_1024; a.dest_qp_num = dqpn; a.rq_psn = 0;
  a.max_dest_rd_atomic = 1; a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1; a.ah_attr.grh.dgid = gid; a.ah_attr.grh.sgid_index = gidx;
  a.ah_attr.grh.hop_limit = 1; a.ah_attr.port_num = 1;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                    IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    DIE("RTR");
  memset(&a, 0, sizeof a);
  // retry_cnt 1 and a short timeout: a failing check fails fast.
  a.qp_state = IBV_QPS_RTS; a.timeout = 10; a.retry_cnt = 1; a.rnr_retry = 1; a.sq_psn = 0;
  a.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                    IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    DIE("RTS");
}

static struct ibv_qp *mkqp(struct ibv_pd *pd, struct ibv_cq *cq, struct ibv_srq *srq) {
  struct ibv_qp_init_attr qa = {.send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = IBV_QPT_RC,
                                .cap = {.max_send_wr = 16, .max_recv_wr = srq ? 0 : 16,
                                        .max_send_sge = 1, .max_recv_sge = 1}};
  return ibv_create_qp(pd, &qa);
}

static void pair(struct ibv_qp *a, struct ibv_qp *b) {
  connect_qp(a, b->qp_num);
  connect_qp(b, a->qp_num);
}

static int post_send(struct ibv_qp *qp, enum ibv_wr_opcode op, void *buf, uint32_t len,
                     uint32_t lkey, uint64_t raddr, uint32_t rkey, uint64_t wr_id) {
  struct ibv_sge s = {(uintptr_t)buf, len, lkey};
  struct ibv_send_wr w = {.wr_id = wr_id, .sg_list = &s, .num_sge = 1, .opcode = op,
                          .send_flags = IBV_SEND_SIGNALED}, *bad;
  w.wr.rdma.remote_addr = raddr;
  w.wr.rdma.rkey = rkey;
  return ibv_post_send(qp, &w, &bad);
}

static void post_srq(struct ibv_srq *srq, void *buf, uint32_t len, uint32_t lkey, uint64_t wr_id) {
  struct ibv_sge s = {(uintptr_t)buf, len, lkey};
  struct ibv_recv_wr w = {.wr_id = wr_id, .sg_list = &s, .num_sge = 1}, *bad;
  if (ibv_post_srq_recv(srq, &w, &bad)) DIE("ibv_post_srq_recv");
}

static void post_rq(struct ibv_qp *qp, void *buf, uint32_t len, uint32_t lkey, uint64_t wr_id) {
  struct ibv_sge s = {(uintptr_t)buf, len, lkey};
  struct ibv_recv_wr w = {.wr_id = wr_id, .sg_list = &s, .num_sge = 1}, *bad;
  if (ibv_post_recv(qp, &w, &bad)) DIE("ibv_post_recv");
}

// WRITE 64 B from src through qp to (raddr, rkey); returns the status string.
static const char *try_write(struct ibv_qp *qp, struct ibv_cq *cq, char *src, struct ibv_mr *smr,
                             uint64_t raddr, uint32_t rkey) {
  struct ibv_wc wc;
  if (post_send(qp, IBV_WR_RDMA_WRITE, src, 64, smr->lkey, raddr, rkey, 7))
    return "post failed";
  if (poll1(cq, &wc)) return "no completion in 2 s";
  return ibv_wc_status_str(wc.status);
}

static void caps(struct ibv_device *dev) {
  struct ibv_context *c = ibv_open_device(dev);
  struct ibv_device_attr_ex a;
  memset(&a, 0, sizeof a);
  if (!c || ibv_query_device_ex(c, NULL, &a)) {
    printf("%s: cannot query\n", ibv_get_device_name(dev));
    return;
  }
  uint64_t f = a.orig_attr.device_cap_flags;
  printf("%s: max_srq %d max_srq_wr %d max_mw %d max_qp %d; memory windows %s, type 2A %s, "
         "type 2B %s\n",
         ibv_get_device_name(dev), a.orig_attr.max_srq, a.orig_attr.max_srq_wr,
         a.orig_attr.max_mw, a.orig_attr.max_qp, f & IBV_DEVICE_MEM_WINDOW ? "yes" : "no",
         f & IBV_DEVICE_MEM_WINDOW_TYPE_2A ? "yes" : "no",
         f & IBV_DEVICE_MEM_WINDOW_TYPE_2B ? "yes" : "no");
  ibv_close_device(c);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *want = getenv("SOFTROCE_DEV") ? getenv("SOFTROCE_DEV") : "rxe0";
  if (getenv("SOFTROCE_GID_INDEX")) gidx = atoi(getenv("SOFTROCE_GID_INDEX"));
  int num;
  struct ibv_device **list = ibv_get_device_list(&num), *dev = NULL;
  if (!list || num == 0) DIE("no RDMA device");
  printf("== 1. capabilities\n");
  for (int i = 0; i < num; i++) {
    caps(list[i]);
    if (!strcmp(ibv_get_device_name(list[i]), want)) dev = list[i];
  }
  if (!dev) DIE("device %s not found", want);
  ctx = ibv_open_device(dev);
  if (!ctx || ibv_query_gid(ctx, 1, gidx, &gid)) DIE("open %s", want);

  struct ibv_pd *pd = ibv_alloc_pd(ctx), *pd_other = ibv_alloc_pd(ctx), *pd_c = ibv_alloc_pd(ctx);
  struct ibv_cq *scq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
  struct ibv_cq *ccq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
  if (!pd || !pd_other || !pd_c || !scq || !ccq) DIE("pd/cq");
  struct ibv_srq_init_attr sa = {.attr = {.max_wr = 64, .max_sge = 1}};
  struct ibv_srq *srq = ibv_create_srq(pd, &sa);
  if (!srq) DIE("ibv_create_srq: %s", strerror(errno));
  char *rbuf = calloc(64, 256);
  struct ibv_mr *rmr = ibv_reg_mr(pd, rbuf, 64 * 256, IBV_ACCESS_LOCAL_WRITE);
  char *cbuf = calloc(1, 4096);
  struct ibv_mr *cmr = ibv_reg_mr(pd_c, cbuf, 4096, IBV_ACCESS_LOCAL_WRITE);
  if (!rmr || !cmr) DIE("reg_mr");
  for (int i = 0; i < 8; i++) post_srq(srq, rbuf + i * 256, 256, rmr->lkey, 100 + i);

  printf("== 2. one SRQ, two QPs\n");
  struct ibv_qp *s1 = mkqp(pd, scq, srq), *s2 = mkqp(pd, scq, srq);
  struct ibv_qp *c1 = mkqp(pd_c, ccq, NULL), *c2 = mkqp(pd_c, ccq, NULL);
  if (!s1 || !s2 || !c1 || !c2) DIE("create_qp");
  pair(s1, c1);
  pair(s2, c2);
  strcpy(cbuf, "from c1");
  strcpy(cbuf + 64, "from c2");
  post_send(c1, IBV_WR_SEND, cbuf, 16, cmr->lkey, 0, 0, 1);
  post_send(c2, IBV_WR_SEND, cbuf + 64, 16, cmr->lkey, 0, 0, 2);
  int ok2 = 0;
  for (int i = 0; i < 2; i++) {
    struct ibv_wc wc;
    if (poll1(scq, &wc)) { printf("receive %d: no completion\n", i); continue; }
    const char *who = wc.qp_num == s1->qp_num ? "s1" : wc.qp_num == s2->qp_num ? "s2" : "?";
    char *data = rbuf + (wc.wr_id - 100) * 256;
    printf("receive on %s: %s, wr_id %llu (SRQ buffer %llu), %u bytes \"%s\"\n", who,
           ibv_wc_status_str(wc.status), (unsigned long long)wc.wr_id,
           (unsigned long long)(wc.wr_id - 100), wc.byte_len, data);
    if (wc.status == IBV_WC_SUCCESS &&
        ((wc.qp_num == s1->qp_num && !strcmp(data, "from c1")) ||
         (wc.qp_num == s2->qp_num && !strcmp(data, "from c2"))))
      ok2++;
  }
  for (int i = 0; i < 2; i++) { struct ibv_wc wc; poll1(ccq, &wc); }
  printf("RESULT shared SRQ delivers per QP: %s\n", ok2 == 2 ? "yes" : "NO");

  printf("== 3. a QP in another PD on the same SRQ\n");
  struct ibv_qp *s3 = mkqp(pd_other, scq, srq);
  if (!s3) {
    printf("RESULT QP in another PD on the SRQ: create refused (%s)\n", strerror(errno));
  } else {
    struct ibv_qp *c3 = mkqp(pd_c, ccq, NULL);
    pair(s3, c3);
    post_send(c3, IBV_WR_SEND, cbuf, 16, cmr->lkey, 0, 0, 3);
    struct ibv_wc wc;
    const char *r = poll1(scq, &wc) ? "no completion" : ibv_wc_status_str(wc.status);
    struct ibv_wc wc2;
    const char *r2 = poll1(ccq, &wc2) ? "no completion" : ibv_wc_status_str(wc2.status);
    printf("RESULT QP in another PD on the SRQ: created; receiver sees \"%s\", sender \"%s\"\n",
           r, r2);
  }

  printf("== 4. type-2 memory window bound to one QP\n");
  char *region = calloc(1, 4096);
  struct ibv_mr *wmr = ibv_reg_mr(pd, region, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  struct ibv_mw *mw = wmr ? ibv_alloc_mw(pd, IBV_MW_TYPE_2) : NULL;
  if (!wmr || !mw) {
    printf("RESULT type-2 window: %s failed (%s)\n", wmr ? "ibv_alloc_mw" : "reg_mr MW_BIND",
           strerror(errno));
  } else {
    uint32_t rkey = ibv_inc_rkey(mw->rkey);
    struct ibv_send_wr w = {.wr_id = 50, .opcode = IBV_WR_BIND_MW, .send_flags = IBV_SEND_SIGNALED},
                       *bad;
    w.bind_mw.mw = mw;
    w.bind_mw.rkey = rkey;
    w.bind_mw.bind_info.mr = wmr;
    w.bind_mw.bind_info.addr = (uintptr_t)region;
    w.bind_mw.bind_info.length = 4096;
    w.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE;
    struct ibv_wc wc;
    int pr = ibv_post_send(s1, &w, &bad);
    const char *b = pr ? "post failed" : poll1(scq, &wc) ? "no completion" : ibv_wc_status_str(wc.status);
    printf("bind on s1: %s (window rkey 0x%x, region's own rkey 0x%x)\n", b, rkey, wmr->rkey);
    // a. through the QP it is bound to
    memset(cbuf + 1024, 'A', 64);
    const char *ra = try_write(c1, ccq, cbuf + 1024, cmr, (uintptr_t)region, rkey);
    int landed = region[0] == 'A' && region[63] == 'A';
    printf("RESULT WRITE with the window's rkey through its QP (c1->s1): %s, data %s\n", ra,
           landed ? "landed" : "NOT landed");
    // b. through another QP of the same PD
    memset(cbuf + 1024, 'B', 64);
    const char *rb = try_write(c2, ccq, cbuf + 1024, cmr, (uintptr_t)region, rkey);
    printf("RESULT WRITE with the same rkey through another QP (c2->s2): %s, region %s\n", rb,
           region[0] == 'B' ? "WRITTEN" : "untouched");
    // c. the region's own rkey (registered without remote access)
    struct ibv_qp *s4 = mkqp(pd, scq, NULL), *c4 = mkqp(pd_c, ccq, NULL);
    pair(s4, c4);
    memset(cbuf + 1024, 'C', 64);
    const char *rc = try_write(c4, ccq, cbuf + 1024, cmr, (uintptr_t)region, wmr->rkey);
    printf("RESULT WRITE with the region's own rkey: %s, region %s\n", rc,
           region[0] == 'C' ? "WRITTEN" : "untouched");
    // d. after the window is deallocated (through its own QP, c1 still fine)
    int dr = ibv_dealloc_mw(mw);
    memset(cbuf + 1024, 'D', 64);
    const char *rd = try_write(c1, ccq, cbuf + 1024, cmr, (uintptr_t)region, rkey);
    printf("RESULT WRITE after ibv_dealloc_mw (%d): %s, region %s\n", dr, rd,
           region[0] == 'D' ? "WRITTEN" : "untouched");
  }
  // Drain what the failed checks left.
  { struct ibv_wc wc; while (ibv_poll_cq(scq, 1, &wc) > 0) {} while (ibv_poll_cq(ccq, 1, &wc) > 0) {} }

  printf("== 5. a QP on the SRQ moved to the error state\n");
  {
    struct ibv_qp *s5 = mkqp(pd, scq, srq), *c5 = mkqp(pd_c, ccq, NULL);
    pair(s5, c5);
    post_send(c5, IBV_WR_SEND, cbuf, 16, cmr->lkey, 0, 0, 5);
    struct ibv_wc wc;
    int got = !poll1(scq, &wc);
    poll1(ccq, &wc);
    int fl = fcntl(ctx->async_fd, F_GETFL);
    fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    if (ibv_modify_qp(s5, &a, IBV_QP_STATE)) DIE("to ERR");
    int flushed = 0;
    double end = now() + 0.5;
    while (now() < end) flushed += ibv_poll_cq(scq, 1, &wc) > 0;
    int last_wqe = 0, events = 0;
    end = now() + 2.0;
    while (now() < end && !last_wqe) {
      struct pollfd p = {.fd = ctx->async_fd, .events = POLLIN};
      if (poll(&p, 1, 100) <= 0) continue;
      struct ibv_async_event ev;
      if (ibv_get_async_event(ctx, &ev)) continue;
      events++;
      printf("async event: %s%s\n", ibv_event_type_str(ev.event_type),
             (ev.event_type == IBV_EVENT_QP_LAST_WQE_REACHED && ev.element.qp == s5) ? " (s5)" : "");
      if (ev.event_type == IBV_EVENT_QP_LAST_WQE_REACHED && ev.element.qp == s5) last_wqe = 1;
      ibv_ack_async_event(&ev);
    }
    printf("RESULT QP on the SRQ to ERR: received before %s, flushed completions %d, "
           "LAST_WQE_REACHED %s (%d async events)\n",
           got ? "yes" : "no", flushed, last_wqe ? "yes" : "NOT seen in 2 s", events);
    ibv_destroy_qp(s5);
    ibv_destroy_qp(c5);
  }

  printf("== 5b. a QP on the SRQ torn down while an 8 MiB SEND arrives\n");
  // The SRQ holds 4 buffers. After the QP is in the error state and
  // destroyed, a fresh QP counts how many the SRQ still has (it receives
  // until one SEND meets an empty SRQ: RNR). 4 - completed - left = buffers
  // taken by the torn-down QP that never completed.
  for (int trial = 0; trial < 6; trial++) {
    static const int delay_us[] = {0, 100, 1000, 3000, 10000, 30000};
    struct ibv_srq_init_attr sa2 = {.attr = {.max_wr = 8, .max_sge = 1}};
    struct ibv_srq *srq2 = ibv_create_srq(pd, &sa2);
    size_t big = 8 << 20;
    char *bb = malloc(4 * big), *src = calloc(1, big);
    struct ibv_mr *bmr = ibv_reg_mr(pd, bb, 4 * big, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *smr = ibv_reg_mr(pd_c, src, big, IBV_ACCESS_LOCAL_WRITE);
    for (int i = 0; i < 4; i++) post_srq(srq2, bb + i * big, big, bmr->lkey, i);
    struct ibv_cq *q6 = ibv_create_cq(ctx, 64, NULL, NULL, 0), *q6c = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    struct ibv_qp *s6 = mkqp(pd, q6, srq2), *c6 = mkqp(pd_c, q6c, NULL);
    pair(s6, c6);
    post_send(c6, IBV_WR_SEND, src, big, smr->lkey, 0, 0, 6);
    double until = now() + delay_us[trial] * 1e-6;
    while (now() < until) {}
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    ibv_modify_qp(s6, &a, IBV_QP_STATE);
    double end = now() + 0.3;
    int completed = 0, flushed = 0;
    struct ibv_wc wc;
    while (now() < end)
      if (ibv_poll_cq(q6, 1, &wc) > 0) { if (wc.status == IBV_WC_SUCCESS) completed++; else flushed++; }
    ibv_destroy_qp(s6);
    ibv_destroy_qp(c6);
    struct ibv_cq *q7 = ibv_create_cq(ctx, 64, NULL, NULL, 0), *q7c = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    struct ibv_qp *s7 = mkqp(pd, q7, srq2), *c7 = mkqp(pd_c, q7c, NULL);
    pair(s7, c7);
    int left = 0;
    for (int i = 0; i < 5; i++) {
      if (post_send(c7, IBV_WR_SEND, src, 64, smr->lkey, 0, 0, 7)) break;
      if (poll1(q7c, &wc) || wc.status != IBV_WC_SUCCESS) break;
      if (poll1(q7, &wc) || wc.status != IBV_WC_SUCCESS) break;
      left++;
    }
    printf("RESULT teardown after %5d us: completed %d, flushed %d, left in the SRQ %d, lost %d\n",
           delay_us[trial], completed, flushed, left, 4 - completed - flushed - left);
    ibv_destroy_qp(s7);
    ibv_destroy_qp(c7);
  }

  printf("== 6. 64 B SEND ping-pong, polled: receive queue against SRQ, 3 rounds each\n");
  for (int round = 0; round < 6; round++) {
    int use_srq = round % 2;
    struct ibv_cq *q1 = ibv_create_cq(ctx, 64, NULL, NULL, 0), *q2 = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    struct ibv_srq *ps = NULL;
    if (use_srq) ps = ibv_create_srq(pd, &sa);
    struct ibv_qp *a = mkqp(pd, q1, ps), *b = mkqp(pd, q2, NULL);
    pair(a, b);
    char *m = calloc(1, 4096);
    struct ibv_mr *mm = ibv_reg_mr(pd, m, 4096, IBV_ACCESS_LOCAL_WRITE);
    for (int i = 0; i < 8; i++) {
      if (use_srq) post_srq(ps, m + 256 * i, 256, mm->lkey, i);
      else post_rq(a, m + 256 * i, 256, mm->lkey, i);
      post_rq(b, m + 2048 + 256 * i, 256, mm->lkey, i);
    }
    int n = 2000;
    double t0 = 0;
    struct ibv_wc wc[4];
    for (int i = -200; i < n; i++) {
      if (i == 0) t0 = now();
      // b -> a
      post_send(b, IBV_WR_SEND, m + 4000, 64, mm->lkey, 0, 0, 9);
      int need = 1;
      while (need) { int r = ibv_poll_cq(q1, 1, wc); if (r > 0 && wc[0].opcode == IBV_WC_RECV) need = 0; }
      if (wc[0].status) DIE("ping %s", ibv_wc_status_str(wc[0].status));
      if (use_srq) post_srq(ps, m + 256 * wc[0].wr_id, 256, mm->lkey, wc[0].wr_id);
      else post_rq(a, m + 256 * wc[0].wr_id, 256, mm->lkey, wc[0].wr_id);
      // a -> b
      post_send(a, IBV_WR_SEND, m + 3900, 64, mm->lkey, 0, 0, 9);
      need = 1;
      while (need) {
        int r = ibv_poll_cq(q2, 1, wc);
        if (r > 0 && wc[0].opcode == IBV_WC_RECV) need = 0;
      }
      if (wc[0].status) DIE("pong %s", ibv_wc_status_str(wc[0].status));
      post_rq(b, m + 2048 + 256 * wc[0].wr_id, 256, mm->lkey, wc[0].wr_id);
      // send completions
      while (ibv_poll_cq(q1, 4, wc) > 0) {}
      while (ibv_poll_cq(q2, 4, wc) > 0) {}
    }
    double us = (now() - t0) / n * 1e6;
    printf("RESULT ping-pong round trip, %s: %.1f us (%d round trips)\n",
           use_srq ? "SRQ" : "receive queue", us, n);
  }
  return 0;
}
