/* What the CPU kernels share: forced inlining and bf16 <-> fp32 as torch converts them.
 * build.py hashes this header with each source, so a change here rebuilds both libraries. */
#ifndef BATCHAPI_COMMON_H
#define BATCHAPI_COMMON_H
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

/* Work dealt to a team of threads in contiguous shares, each thread's taken from its front by
 * itself and, once a thread has done its own, from the back by the others: a thread that runs
 * slower (a vCPU the host runs less, a share whose memory comes slower) no longer keeps the team
 * waiting at the region's end, and a share still runs in order, so that a thread reads its part of
 * the memory as one stream, which the hardware's prefetchers follow. A unit's result never depends on
 * the thread that computes it. A share is one 64-bit word: its next unit (low half) and its end. */
#define MAX_TEAM 256
typedef struct {
    /* a cache line each: an owner's taking from its own share stays in its core's cache (in one
     * line, every unit's compare-and-swap moved it between the cores: 1.5% of a decode step) */
    struct {
        uint64_t word;
    } __attribute__((aligned(64))) share[MAX_TEAM];
    int team;
} Deal;

INLINE uint64_t deal_word(int64_t front, int64_t end) { return (uint64_t)(uint32_t)front | (uint64_t)end << 32; }

/* `units` (under 2^31) in `team` (at most MAX_TEAM) even shares: thread t's from units * t / team */
INLINE void deal_even(Deal *deal, int team, int64_t units) {
    deal->team = team;
    for (int t = 0; t < team; t++) deal->share[t].word = deal_word(units * t / team, units * (t + 1) / team);
}

/* units of thread t's share from its front, [*first, *last): a quarter of what is left (at least
 * one), so that few claims are made (each is a locked instruction, which waits for the stores of the
 * unit before: its outputs), and the last units one at a time; 0 where none is left */
INLINE int deal_own(Deal *deal, int t, int64_t *first, int64_t *last) {
    uint64_t w = __atomic_load_n(&deal->share[t].word, __ATOMIC_ACQUIRE);
    for (;;) {
        const int64_t front = (uint32_t)w, end = (int64_t)(w >> 32);
        if (front >= end) return 0;
        const int64_t take = (end - front) / 4 > 1 ? (end - front) / 4 : 1;
        if (__atomic_compare_exchange_n(&deal->share[t].word, &w, deal_word(front + take, end), 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            *first = front, *last = front + take;
            return 1;
        }
    }
}

/* the last unit of the share with the most left, taken from its back by thread t, or -1 where no
 * share has any left */
INLINE int64_t deal_steal(Deal *deal, int t) {
    for (;;) {
        int victim = -1;
        int64_t most = 0;
        uint64_t seen = 0; /* the victim's word as read */
        for (int v = 0; v < deal->team; v++) {
            const uint64_t w = __atomic_load_n(&deal->share[v].word, __ATOMIC_ACQUIRE);
            const int64_t left = (int64_t)(w >> 32) - (int64_t)(uint32_t)w;
            if (v != t && left > most) most = left, victim = v, seen = w;
        }
        if (victim < 0) return -1;
        const int64_t front = (uint32_t)seen, end = (int64_t)(seen >> 32);
        if (__atomic_compare_exchange_n(&deal->share[victim].word, &seen, deal_word(front, end - 1), 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return end - 1; /* else the share moved since: look again */
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(_GNU_SOURCE)
/* AMX's tile registers, for the sources that use them (they define _GNU_SOURCE before their includes,
 * for syscall()): Linux hands a process their state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM),
 * and a kernel loads its tiles' shapes (a TileConfig) in each thread before it uses them, and
 * releases them after */
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static inline int amx_permitted(void) {
    static int state = 0; /* 0 unasked, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}
#endif

#endif
