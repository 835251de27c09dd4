/* A keeper's data plane in native code: the pass over its workers' staging slots (tier-1 fold,
 * tier-2 records), one sender and one receiver thread per peer keeper (tier-2 batches over TCP,
 * folded into tier-2 parity on arrival). Python keeps the control: the commit barrier, drains,
 * reports (docs/protection.md, "The native data plane"). The wire format, the slot protocol and
 * the region's tables are those of transport.py, shm.py and parity.py; dataplane.py loads this
 * library with ctypes and says which layouts it serves (deltas, codes whose coefficients are 1).
 *
 * Memory order: a worker publishes a slot with S_READY = STAGED after its bytes and header (x86-64
 * total store order, shm.py); this side reads S_READY with acquire, writes a chunk's version
 * last with release, so that a reader that sees the version sees its parity and checksum. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#define HDR 8    /* int64 fields of a tier-2 record header (transport.HDR) */
#define PREFIX 2 /* int64 fields before a batch's records: kind, count (transport.PREFIX) */
#define NBUF 2   /* batches per link: one filling, one in flight (transport.SEND_BUFFERS) */
#define IOV_MAX_ 1024
#define S_READY 0
#define S_KIND 1
#define S_STEP 2
#define S_CHUNK 3
#define S_CRC 4
#define SLOT_FREE 0
#define SLOT_STAGED 1
#define SLOT_HELD 2
#define KIND_DELTA 2
#define NO_WANT INT64_MAX

enum { E_NONE, E_SEND, E_RECV, E_BATCH, E_RECORD };

/* The constants above, in the order dataplane.py checks them against the Python plane's. */
void dp_constants(int64_t *out) {
    int64_t c[] = {HDR, PREFIX, NBUF, S_READY, S_KIND, S_STEP, S_CHUNK, S_CRC,
                   SLOT_FREE, SLOT_STAGED, SLOT_HELD, KIND_DELTA};
    memcpy(out, c, sizeof c);
}

typedef struct {
    int64_t prefix[PREFIX];
    int64_t *hdrs; /* per_msg record headers */
    const uint8_t **bodies; /* each record's body: its staging slot's bytes */
    int32_t *slot; /* each record's slot (worker * ring + index), handed back once sent */
    int n;
} Batch;

typedef struct DP DP;

typedef struct {
    DP *dp;
    int fd_out, fd_in;
    Batch b[NBUF];
    int free_mask, open; /* buffers free; the one filling (-1: none) */
    int q[NBUF], qh, ql; /* batches to send, in order */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t sent, received; /* messages */
    int error, err_no;
    int64_t err_a, err_b, err_c, waited_ns;
    pthread_t snd, rcv;
    int has_snd, has_rcv;
    uint8_t *rbuf;
    struct iovec *iov;
} Link;

struct DP {
    int W, ring, nc, fields, per_msg, nlinks, max_links, ns, max_stripes;
    int64_t nb, slot_bytes, idx, gen;
    int64_t *slot_hdr;
    uint8_t *slot_data;
    int64_t *next; /* per worker: its next slot to take */
    int32_t *holds; /* per slot: holds on it (the pass's, one per batch sending from it) */
    uint64_t *p1;
    int64_t *crc1, *v1;
    int32_t *rlink; /* per data position: the link its tier-2 record goes over, -1: none */
    int64_t *rstripe, *rp, *ri;
    Link *links;
    int64_t *sid; /* per stripe this keeper holds parity of */
    uint64_t **p2;
    int64_t **crc2, **v2;
    const uint8_t **real; /* whether (position, offset) holds a real chunk: padding has no version */
    int32_t *P;
    int L;
    double timeout_s;
    int sig;
    pthread_t main_tid;
    int wants_room; /* the pass found a link's buffers full: its sender rings when one frees */
    int64_t want; /* the step the next commit barrier waits for (NO_WANT: one is in flight) */
    int stopping;
    int frozen; /* reported: nothing folds any more */
    pthread_mutex_t fold_mu; /* a receiver's batch folds whole, or not at all once frozen */
    int64_t errors;
};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* d ^= s: the folds. Built for the widest vectors the CPU has, chosen when the library loads
 * (a portable build: SSE2 alone measured 20 % more of the keepers' CPU than AVX2/AVX-512). */
__attribute__((target_clones("avx512f", "avx2", "default"))) static void xor_into(uint64_t *restrict d,
                                                                                  const uint64_t *restrict s,
                                                                                  int64_t nb) {
    for (int64_t k = 0; k < nb / 8; k++) d[k] ^= s[k];
}

/* dst = old ^ nw (nw where old is NULL), n bytes: a worker's delta into its staging slot. The
 * slot's last reader is the keeper, on another core: a store through the cache first fetches each
 * line back from there, which measured as half of staging a chunk; streaming stores do not. They
 * are weakly ordered, hence the fence: the caller publishes the slot with a plain store after. */
void dp_stage(uint8_t *restrict dst, const uint8_t *restrict old, const uint8_t *restrict nw, int64_t n) {
    int64_t i = 0;
#if defined(__x86_64__)
    for (; i < n && ((uintptr_t)(dst + i) & 15); i++) dst[i] = old ? old[i] ^ nw[i] : nw[i];
    for (; i + 64 <= n; i += 64)
        for (int k = 0; k < 64; k += 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)(nw + i + k));
            if (old) v = _mm_xor_si128(v, _mm_loadu_si128((const __m128i *)(old + i + k)));
            _mm_stream_si128((__m128i *)(dst + i + k), v);
        }
    _mm_sfence();
#endif
    for (; i < n; i++) dst[i] = old ? old[i] ^ nw[i] : nw[i];
}

static void ring_main(DP *dp) { pthread_kill(dp->main_tid, dp->sig); }

static void hand_back(DP *dp, int32_t slot) {
    if (__atomic_sub_fetch(&dp->holds[slot], 1, __ATOMIC_ACQ_REL) == 0)
        __atomic_store_n(&dp->slot_hdr[(int64_t)slot * dp->fields + S_READY], SLOT_FREE, __ATOMIC_RELEASE);
}

static void fail(Link *l, int code, int err_no, int64_t a, int64_t b, int64_t c, int64_t t0) {
    DP *dp = l->dp;
    if (__atomic_load_n(&dp->stopping, __ATOMIC_ACQUIRE) || l->error) return;
    l->err_no = err_no, l->err_a = a, l->err_b = b, l->err_c = c, l->waited_ns = now_ns() - t0;
    __atomic_store_n(&l->error, code, __ATOMIC_RELEASE);
    __atomic_add_fetch(&dp->errors, 1, __ATOMIC_ACQ_REL);
    ring_main(dp);
}

int64_t dp_applied(DP *dp) {
    int64_t m = NO_WANT;
    for (int k = 0; k < dp->W * dp->nc; k++) {
        int64_t v = __atomic_load_n(&dp->v1[k], __ATOMIC_ACQUIRE);
        if (v < m) m = v;
    }
    for (int s = 0; s < dp->ns; s++)
        for (int k = 0; k < dp->P[s] * dp->L; k++)
            if (dp->real[s][k]) {
                int64_t v = __atomic_load_n(&dp->v2[s][k], __ATOMIC_ACQUIRE);
                if (v < m) m = v;
            }
    return m;
}

/* Send every byte of iov, gathered where it lies; 0, or errno (EAGAIN: past the timeout). */
static int send_all(int fd, struct iovec *iov, int cnt, int64_t deadline) {
    while (cnt > 0) {
        ssize_t n = writev(fd, iov, cnt > IOV_MAX_ ? IOV_MAX_ : cnt);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        while (cnt > 0 && (size_t)n >= iov->iov_len) n -= iov->iov_len, iov++, cnt--;
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + n;
            iov->iov_len -= n;
            if (now_ns() > deadline) return EAGAIN;
        }
    }
    return 0;
}

/* 0, -1 at the end of the stream, or errno (EAGAIN: a read waited past the timeout) */
static int read_exactly(int fd, uint8_t *p, int64_t n) {
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return errno;
        if (k == 0) return -1;
        p += k, n -= k;
    }
    return 0;
}

static void *send_loop(void *arg) {
    Link *l = arg;
    DP *dp = l->dp;
    int64_t keepalive[PREFIX] = {0, 0}; /* a batch of no records: the peer lives (transport.Link) */
    int64_t every = (int64_t)(dp->timeout_s / 4 * 1e9);
    pthread_setname_np(pthread_self(), "keeper-send");
    for (;;) {
        pthread_mutex_lock(&l->mu);
        while (l->ql == 0 && !dp->stopping) {
            struct timespec t;
            clock_gettime(CLOCK_MONOTONIC, &t);
            int64_t at = (int64_t)t.tv_sec * 1000000000 + t.tv_nsec + every;
            t.tv_sec = at / 1000000000, t.tv_nsec = at % 1000000000;
            if (pthread_cond_timedwait(&l->cv, &l->mu, &t) == ETIMEDOUT && l->ql == 0 && !dp->stopping) {
                pthread_mutex_unlock(&l->mu);
                struct iovec v = {keepalive, sizeof keepalive};
                int64_t t0 = now_ns();
                int e = send_all(l->fd_out, &v, 1, t0 + (int64_t)(dp->timeout_s * 1e9));
                if (e) {
                    fail(l, E_SEND, e, 0, 0, 0, t0);
                    return NULL;
                }
                pthread_mutex_lock(&l->mu);
            }
        }
        if (dp->stopping) {
            pthread_mutex_unlock(&l->mu);
            return NULL;
        }
        int bi = l->q[l->qh];
        l->qh = (l->qh + 1) % NBUF, l->ql--;
        pthread_mutex_unlock(&l->mu);
        Batch *b = &l->b[bi];
        int c = 0;
        l->iov[c++] = (struct iovec){b->prefix, sizeof b->prefix};
        for (int r = 0; r < b->n; r++) {
            l->iov[c++] = (struct iovec){b->hdrs + r * HDR, HDR * 8};
            l->iov[c++] = (struct iovec){(void *)b->bodies[r], dp->nb};
        }
        int64_t t0 = now_ns();
        int e = send_all(l->fd_out, l->iov, c, t0 + (int64_t)(dp->timeout_s * 1e9));
        if (e) { /* its slots stay held, as the Python plane's: the generation is over for this link */
            fail(l, E_SEND, e, 1, 0, 0, t0);
            return NULL;
        }
        for (int r = 0; r < b->n; r++) hand_back(dp, b->slot[r]);
        b->n = 0;
        pthread_mutex_lock(&l->mu);
        l->free_mask |= 1 << bi;
        __atomic_add_fetch(&l->sent, 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&l->mu);
        if (__atomic_load_n(&dp->wants_room, __ATOMIC_ACQUIRE)) ring_main(dp);
    }
}

static int stripe_index(DP *dp, int64_t stripe) {
    for (int s = 0; s < dp->ns; s++)
        if (dp->sid[s] == stripe) return s;
    return -1;
}

static void *recv_loop(void *arg) {
    Link *l = arg;
    DP *dp = l->dp;
    int64_t prefix[PREFIX], rb = HDR * 8 + dp->nb;
    pthread_setname_np(pthread_self(), "keeper-recv");
    for (;;) {
        int64_t t0 = now_ns();
        int e = read_exactly(l->fd_in, (uint8_t *)prefix, sizeof prefix);
        if (e) {
            fail(l, E_RECV, e < 0 ? 0 : e, 0, 0, 0, t0);
            return NULL;
        }
        int64_t kind = prefix[0], n = prefix[1];
        if (n == 0) continue; /* a keepalive */
        if (kind != KIND_DELTA || n < 0 || n > dp->per_msg) {
            fail(l, E_BATCH, 0, n, kind, 0, t0);
            return NULL;
        }
        e = read_exactly(l->fd_in, l->rbuf, n * rb);
        if (e) {
            fail(l, E_RECV, e < 0 ? 0 : e, 0, 0, 0, t0);
            return NULL;
        }
        pthread_mutex_lock(&dp->fold_mu);
        if (!dp->frozen) {
            for (int64_t r = 0; r < n; r++) { /* check every record before folding any: a batch folds whole */
                int64_t *h = (int64_t *)(l->rbuf + r * rb);
                int s = stripe_index(dp, h[3]);
                if (s < 0 || h[4] < 0 || h[4] >= dp->P[s] || h[5] < 0 || h[5] >= dp->L) {
                    pthread_mutex_unlock(&dp->fold_mu);
                    fail(l, E_RECORD, 0, h[3], h[4], h[5], t0);
                    return NULL;
                }
            }
            for (int64_t r = 0; r < n; r++) {
                int64_t *h = (int64_t *)(l->rbuf + r * rb);
                int s = stripe_index(dp, h[3]);
                int64_t step = h[1], p = h[4], i = h[5], at = p * dp->L + i;
                xor_into(dp->p2[s] + i * (dp->nb / 8), (const uint64_t *)(h + HDR), dp->nb);
                dp->crc2[s][at] = h[6];
                __atomic_store_n(&dp->v2[s][at], step, __ATOMIC_RELEASE);
            }
        }
        int frozen = dp->frozen;
        pthread_mutex_unlock(&dp->fold_mu);
        __atomic_add_fetch(&l->received, 1, __ATOMIC_RELEASE);
        __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the versions stored before `want` is read: see dp_set_want */
        /* ring only when the next barrier can be entered: a wake-up a batch costs more than the fold */
        int64_t want = __atomic_load_n(&dp->want, __ATOMIC_SEQ_CST);
        if (!frozen && want != NO_WANT && dp_applied(dp) >= want) ring_main(dp);
    }
}

static void enqueue(Link *l) {
    Batch *b = &l->b[l->open];
    b->prefix[0] = KIND_DELTA, b->prefix[1] = b->n;
    pthread_mutex_lock(&l->mu);
    l->q[(l->qh + l->ql) % NBUF] = l->open;
    l->ql++;
    l->open = -1;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

void dp_flush(DP *dp) {
    for (int li = 0; li < dp->nlinks; li++)
        if (dp->links[li].open >= 0) enqueue(&dp->links[li]);
}

/* Take what the workers staged: fold each slot into tier-1 parity, add its tier-2 record to its
 * link's batch (sent from the slot), then send the open batches. Returns the slots taken; -1 when
 * none was taken because a link's buffers are full; -2 on a slot of a kind this plane does not take. */
int dp_pass(DP *dp) {
    int taken = 0, full = 0;
    for (int w = 0; w < dp->W; w++) {
        for (int k = 0; k < dp->ring; k++) {
            int32_t slot = w * dp->ring + (int32_t)(dp->next[w] % dp->ring);
            int64_t *h = dp->slot_hdr + (int64_t)slot * dp->fields;
            if (__atomic_load_n(&h[S_READY], __ATOMIC_ACQUIRE) != SLOT_STAGED) break;
            int64_t kind = h[S_KIND], step = h[S_STEP], chunk = h[S_CHUNK], crc = h[S_CRC];
            if (kind != KIND_DELTA || chunk < 0 || chunk >= dp->nc) return -2;
            const uint8_t *payload = dp->slot_data + (int64_t)slot * dp->slot_bytes;
            int64_t pos = (int64_t)w * dp->nc + chunk;
            Link *l = dp->rlink[pos] >= 0 ? &dp->links[dp->rlink[pos]] : NULL;
            if (l && __atomic_load_n(&l->error, __ATOMIC_ACQUIRE)) l = NULL; /* broken: its batches never leave */
            if (l && l->open < 0) {
                __atomic_store_n(&dp->wants_room, 1, __ATOMIC_SEQ_CST); /* before looking (the sender rings) */
                pthread_mutex_lock(&l->mu);
                if (l->free_mask) {
                    l->open = __builtin_ctz(l->free_mask);
                    l->free_mask &= ~(1 << l->open);
                }
                pthread_mutex_unlock(&l->mu);
                if (l->open < 0) {
                    full = 1;
                    break; /* this worker's slots wait; the next worker's may go over another link */
                }
                __atomic_store_n(&dp->wants_room, 0, __ATOMIC_RELEASE);
            }
            __atomic_store_n(&dp->holds[slot], 1 + (l != NULL), __ATOMIC_RELEASE);
            __atomic_store_n(&h[S_READY], SLOT_HELD, __ATOMIC_RELEASE);
            if (l) {
                Batch *b = &l->b[l->open];
                int64_t *r = b->hdrs + b->n * HDR;
                r[0] = KIND_DELTA, r[1] = step, r[2] = dp->idx, r[3] = dp->rstripe[pos], r[4] = dp->rp[pos];
                r[5] = dp->ri[pos], r[6] = crc, r[7] = dp->gen;
                b->bodies[b->n] = payload, b->slot[b->n] = slot;
                if (++b->n == dp->per_msg) enqueue(l);
            }
            xor_into(dp->p1 + chunk * (dp->nb / 8), (const uint64_t *)payload, dp->nb);
            dp->crc1[pos] = crc;
            __atomic_store_n(&dp->v1[pos], step, __ATOMIC_RELEASE);
            hand_back(dp, slot);
            dp->next[w]++;
            taken++;
        }
    }
    if (taken) dp_flush(dp); /* an open batch holds its slots: a worker may be waiting for one */
    return taken ? taken : full ? -1 : 0;
}

/* Whether a worker's next slot is staged and not yet taken. */
int dp_staged(DP *dp) {
    for (int w = 0; w < dp->W; w++) {
        int64_t *h = dp->slot_hdr + (int64_t)(w * dp->ring + dp->next[w] % dp->ring) * dp->fields;
        if (__atomic_load_n(&h[S_READY], __ATOMIC_ACQUIRE) == SLOT_STAGED) return 1;
    }
    return 0;
}

/* The next barrier waits for `want` (NO_WANT: one is in flight); whether it can be entered now
 * (a receiver that folded the last record before this call did not ring for it). */
int dp_set_want(DP *dp, int64_t want) {
    __atomic_store_n(&dp->want, want, __ATOMIC_SEQ_CST);
    return want != NO_WANT && dp_applied(dp) >= want;
}

/* From now on nothing folds: the region is what the report says. */
void dp_freeze(DP *dp) {
    pthread_mutex_lock(&dp->fold_mu);
    dp->frozen = 1;
    pthread_mutex_unlock(&dp->fold_mu);
}

int64_t dp_errors(DP *dp) { return __atomic_load_n(&dp->errors, __ATOMIC_ACQUIRE); }

enum { SERVE_BARRIER = 1, SERVE_CONTROL = 2, SERVE_TIME = 4, SERVE_ERROR = 8, SERVE_IN_FLIGHT = 16 };

/* The keeper's main loop while nothing needs Python (call on the thread that takes the doorbells,
 * with them blocked): take what is staged, then sleep until a doorbell rings, as Keeper.run does;
 * a sleep after work lasts `idle_s[0]`, doubling while idle up to `idle_s[1]`. Returns why Python
 * is needed: the next barrier can be entered (SERVE_BARRIER), the control doorbell rang, `until`
 * (CLOCK_MONOTONIC seconds) passed, a link broke, or a doorbell rang while a barrier is in flight
 * (its thread rings when it ends). */
int dp_serve(DP *dp, double until, double idle_min, double idle_max, int control) {
    sigset_t bells;
    sigemptyset(&bells);
    sigaddset(&bells, dp->sig);
    sigaddset(&bells, control);
    int64_t errors = dp_errors(dp);
    double idle = idle_min;
    for (;;) {
        int taken = dp_pass(dp);
        if (taken == -2) return taken;
        if (dp_errors(dp) != errors) return SERVE_ERROR;
        int64_t want = __atomic_load_n(&dp->want, __ATOMIC_SEQ_CST);
        if (want != NO_WANT && dp_applied(dp) >= want) return SERVE_BARRIER;
        double now = now_ns() / 1e9;
        if (now >= until) return SERVE_TIME;
        idle = taken > 0 ? idle_min : idle * 2 < idle_max ? idle * 2 : idle_max;
        double nap = until - now < idle ? until - now : idle;
        struct timespec t = {(time_t)nap, (long)((nap - (time_t)nap) * 1e9)};
        int sig = sigtimedwait(&bells, NULL, &t);
        if (sig == control) return SERVE_CONTROL;
        if (sig == dp->sig && want == NO_WANT) return SERVE_IN_FLIGHT;
    }
}

/* Link `li`: sent, received, idle, error, errno, a, b, c, waited ns */
void dp_link_state(DP *dp, int li, int64_t *out) {
    Link *l = &dp->links[li];
    pthread_mutex_lock(&l->mu);
    out[0] = l->sent, out[1] = l->received;
    out[2] = l->open < 0 && l->ql == 0 && l->free_mask == (1 << NBUF) - 1;
    pthread_mutex_unlock(&l->mu);
    out[3] = __atomic_load_n(&l->error, __ATOMIC_ACQUIRE);
    out[4] = l->err_no, out[5] = l->err_a, out[6] = l->err_b, out[7] = l->err_c, out[8] = l->waited_ns;
}

DP *dp_new(int W, int ring, int nc, int fields, int64_t nb, int64_t slot_bytes, int64_t *slot_hdr, uint8_t *slot_data,
           uint64_t *p1, int64_t *crc1, int64_t *v1, int per_msg, int64_t idx, int64_t gen, double timeout_s, int sig,
           unsigned long main_tid, int max_links, int max_stripes) {
    DP *dp = calloc(1, sizeof *dp);
    if (!dp) return NULL;
    dp->W = W, dp->ring = ring, dp->nc = nc, dp->fields = fields, dp->nb = nb, dp->slot_bytes = slot_bytes;
    dp->slot_hdr = slot_hdr, dp->slot_data = slot_data, dp->p1 = p1, dp->crc1 = crc1, dp->v1 = v1;
    dp->per_msg = per_msg, dp->idx = idx, dp->gen = gen, dp->timeout_s = timeout_s, dp->sig = sig;
    dp->main_tid = (pthread_t)main_tid, dp->want = NO_WANT;
    dp->max_links = max_links, dp->max_stripes = max_stripes;
    pthread_mutex_init(&dp->fold_mu, NULL);
    dp->next = calloc(W, sizeof(int64_t));
    dp->holds = calloc((size_t)W * ring, sizeof(int32_t));
    dp->rlink = malloc(sizeof(int32_t) * W * nc);
    dp->rstripe = calloc((size_t)W * nc, 8), dp->rp = calloc((size_t)W * nc, 8), dp->ri = calloc((size_t)W * nc, 8);
    dp->links = calloc(max_links ? max_links : 1, sizeof(Link));
    dp->sid = calloc(max_stripes ? max_stripes : 1, 8);
    dp->p2 = calloc(max_stripes ? max_stripes : 1, sizeof(uint64_t *));
    dp->crc2 = calloc(max_stripes ? max_stripes : 1, sizeof(int64_t *));
    dp->v2 = calloc(max_stripes ? max_stripes : 1, sizeof(int64_t *));
    dp->real = calloc(max_stripes ? max_stripes : 1, sizeof(uint8_t *));
    dp->P = calloc(max_stripes ? max_stripes : 1, sizeof(int32_t));
    for (int k = 0; k < W * nc; k++) dp->rlink[k] = -1;
    return dp;
}

void dp_route(DP *dp, int pos, int link, int64_t stripe, int64_t p, int64_t i) {
    dp->rlink[pos] = link, dp->rstripe[pos] = stripe, dp->rp[pos] = p, dp->ri[pos] = i;
}

void dp_stripe(DP *dp, int64_t sid, uint64_t *p2, int64_t *crc2, int64_t *v2, const uint8_t *real, int P, int L) {
    int s = dp->ns++;
    dp->sid[s] = sid, dp->p2[s] = p2, dp->crc2[s] = crc2, dp->v2[s] = v2, dp->real[s] = real, dp->P[s] = P;
    dp->L = L;
}

int dp_link(DP *dp, int fd_out, int fd_in) {
    int li = dp->nlinks++;
    Link *l = &dp->links[li];
    l->dp = dp, l->fd_out = fd_out, l->fd_in = fd_in, l->open = -1, l->free_mask = (1 << NBUF) - 1;
    pthread_mutex_init(&l->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&l->cv, &ca);
    for (int bi = 0; bi < NBUF; bi++) {
        l->b[bi].hdrs = calloc((size_t)dp->per_msg * HDR, 8);
        l->b[bi].bodies = calloc(dp->per_msg, sizeof(uint8_t *));
        l->b[bi].slot = calloc(dp->per_msg, sizeof(int32_t));
    }
    l->iov = calloc(1 + 2 * (size_t)dp->per_msg, sizeof(struct iovec));
    l->rbuf = malloc((size_t)dp->per_msg * (HDR * 8 + dp->nb));
    return li;
}

/* Start the links' threads, with every signal blocked: a doorbell is the main thread's. */
int dp_start(DP *dp) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int e = 0;
    for (int li = 0; li < dp->nlinks && !e; li++) {
        Link *l = &dp->links[li];
        if (l->fd_out >= 0 && !(e = pthread_create(&l->snd, NULL, send_loop, l))) l->has_snd = 1;
        if (!e && l->fd_in >= 0 && !(e = pthread_create(&l->rcv, NULL, recv_loop, l))) l->has_rcv = 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return e;
}

/* End the links' threads (a send or read in progress fails on the shutdown) and wait for them. */
void dp_stop(DP *dp) {
    __atomic_store_n(&dp->stopping, 1, __ATOMIC_SEQ_CST);
    for (int li = 0; li < dp->nlinks; li++) {
        Link *l = &dp->links[li];
        pthread_mutex_lock(&l->mu);
        pthread_cond_broadcast(&l->cv);
        pthread_mutex_unlock(&l->mu);
        if (l->fd_in >= 0) shutdown(l->fd_in, SHUT_RDWR);
        if (l->fd_out >= 0) shutdown(l->fd_out, SHUT_RDWR);
    }
    for (int li = 0; li < dp->nlinks; li++) {
        Link *l = &dp->links[li];
        if (l->has_snd) pthread_join(l->snd, NULL);
        if (l->has_rcv) pthread_join(l->rcv, NULL);
        l->has_snd = l->has_rcv = 0;
    }
}

void dp_free(DP *dp) {
    for (int li = 0; li < dp->nlinks; li++) {
        Link *l = &dp->links[li];
        for (int bi = 0; bi < NBUF; bi++) free(l->b[bi].hdrs), free(l->b[bi].bodies), free(l->b[bi].slot);
        free(l->iov), free(l->rbuf);
    }
    free(dp->links), free(dp->next), free(dp->holds), free(dp->rlink), free(dp->rstripe), free(dp->rp), free(dp->ri);
    free(dp->sid), free(dp->p2), free(dp->crc2), free(dp->v2), free(dp->real), free(dp->P);
    free(dp);
}
