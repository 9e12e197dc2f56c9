/*
 * The fleet budget on a DynamoDB table (issue 17 item 1), as models/README.md specifies it
 * ("Slot protocol: implementation contract"): one item per Auto Scaling group holding the
 * group's holders (at most B of them), each `reserved` or `committed`. Every write is
 * conditional on the item's version as the writer read it (a compare-and-set; DynamoDB
 * evaluates a ConditionExpression and applies the write atomically per item) and increments
 * it. reserve -> commit -> only then act (drain). A committed holder never expires on a
 * timer: it is removed by its holder when it leaves remediation, or by any gpu-medic of the
 * group once Auto Scaling says the holder left the group (terminated: a fact that never
 * reverts). A reservation whose owner stalls may be taken over.
 *
 * There is no clock in this model at all. A gpu-medic that finds the item full may take
 * over any reservation at any moment after reading it: that covers every clock (skew,
 * drift, no shared clock) and every reservation lifetime. Interleaving covers pauses of any
 * length between any two steps.
 *
 * Checked: at most B instances act (in remediation) at once: an assertion when an instance
 * starts its drain; and the item never holds more than B holders. With -DLIVENESS the LTL
 * property `gone_released`: an entry held by an instance that left the group is always
 * eventually removed (run with pan -a -f: weak fairness).
 *
 * Faults and environment (switches):
 *   -DFAULT_CRASH=k   up to k crashes of gpu-medic processes at any point, each restarted
 *                     (local state lost; the item and the instance's state survive)
 *   -DFAULT_STALE=k   up to k reads return an older version of the item (eventually
 *                     consistent / delayed reads; unbounded when k = 255)
 *   -DFAULT_GONE=k    Auto Scaling terminates up to k instances at any time: the gpu-medic
 *                     there dies for ever; other gpu-medics may see the fact late (up to
 *                     LAG reads say it is still there)
 *   -DFAULT_SHRINK    the budget drops from B to B-1 at any time (scale-in, percent budget)
 * Mutants, each expected to break the invariant (they show the check has teeth):
 *   -DMUTANT_LEASE        a committed holder can be taken over like a reservation (a lease
 *                         that expires on a timer)
 *   -DMUTANT_BLIND_COMMIT the commit is not conditional (SET holders.me = committed)
 *   -DMUTANT_NO_RELEASE   nobody removes the entry of a terminated holder (breaks
 *                         gone_released: a committed entry would be held for ever)
 */

#ifndef N
#define N 3
#endif
#ifndef B
#define B 1
#endif
#ifndef K
#define K 2        /* how many older versions a stale read may return */
#endif
#ifndef LAG
#define LAG 2      /* reads of Auto Scaling that may miss a termination, in all */
#endif
#ifndef FAULT_CRASH
#define FAULT_CRASH 0
#endif
#ifndef FAULT_STALE
#define FAULT_STALE 0
#endif
#ifndef FAULT_GONE
#define FAULT_GONE 0
#endif

/* an entry of the holder map */
#define NO  0
#define RES 1
#define COM 2
/* the holder map, packed: 2 bits per instance */
#define ENT(m, h) (((m) >> (2 * (h))) & 3)
#define SETENT(m, h, e) (((m) & ~(3 << (2 * (h)))) | ((e) << (2 * (h))))

/* st[i]: the instance, ground truth */
#define WANTS 0   /* in service, faulted: wants a drain */
#define REM   1   /* acting: DRAINING / replacing */
#define OK    2   /* remediation over, back in service */
#define GONE  3   /* terminated: left the group; its gpu-medic is dead */

#define P_READ   0
#define P_DECIDE 1
#define P_ACT    2 /* committed in this lifetime: the drain call */

#if N == 3
#define COUNT(m) ((ENT(m, 0) != NO) + (ENT(m, 1) != NO) + (ENT(m, 2) != NO))
#define NREM ((st[0] == REM) + (st[1] == REM) + (st[2] == REM))
#define HBG ((gone[0] && ENT(item, 0) != NO) || (gone[1] && ENT(item, 1) != NO) || \
             (gone[2] && ENT(item, 2) != NO))
#define ACTING_HELD ((st[0] != REM || ENT(item, 0) == COM) && (st[1] != REM || ENT(item, 1) == COM) && \
                     (st[2] != REM || ENT(item, 2) == COM))
#elif N == 4
#define COUNT(m) ((ENT(m, 0) != NO) + (ENT(m, 1) != NO) + (ENT(m, 2) != NO) + (ENT(m, 3) != NO))
#define NREM ((st[0] == REM) + (st[1] == REM) + (st[2] == REM) + (st[3] == REM))
#define HBG ((gone[0] && ENT(item, 0) != NO) || (gone[1] && ENT(item, 1) != NO) || \
             (gone[2] && ENT(item, 2) != NO) || (gone[3] && ENT(item, 3) != NO))
#define ACTING_HELD ((st[0] != REM || ENT(item, 0) == COM) && (st[1] != REM || ENT(item, 1) == COM) && \
                     (st[2] != REM || ENT(item, 2) == COM) && (st[3] != REM || ENT(item, 3) == COM))
#else
#error "N must be 3 or 4"
#endif

byte item;          /* the item's holder map; its version is implicit: see dirty */
byte hist[K];       /* the item's previous contents, newest first */
byte pc[N];         /* where instance i's gpu-medic is */
byte rh[N];         /* the item as i's gpu-medic last read or wrote it */
bit dirty[N];       /* the item has been written since i's read, or the read was stale: a
                       write conditional on that read's version fails */
byte st[N];
bit gone[N];        /* Auto Scaling: i is terminated (never reverts) */
byte bnow = B;      /* the budget now */
byte crashes, ngone, stale_used, lag_used;
byte tv;            /* scratch, 0 between steps */

hidden byte hh, hg, hnew, hok;

/* i's own entry of a map: all a gpu-medic with an outdated read can still act on (every
 * write it tries fails), so that is all the model keeps of such a read */
#define OWN(m, i) ((m) & (3 << (2 * (i))))

/* the conditional write: succeeds iff the item still has the version that me read */
inline cas(me, newm) {
  hok = !dirty[me];
  if
  :: hok ->
     for (hh : 1 .. K - 1) { hist[K - hh] = hist[K - 1 - hh] }
     hist[0] = item;
     item = newm;
     for (hh : 0 .. N - 1) {
       if
       :: hh != me && pc[hh] == P_DECIDE -> dirty[hh] = 1; rh[hh] = OWN(rh[hh], hh)
       :: else
       fi
     }
     rh[me] = item;
     assert(COUNT(item) <= B && ACTING_HELD)
  :: else
  fi
}

inline act(me) {
  st[me] = REM;
  printf("i%d: DRAINING; acting now: %d (budget %d)\n", me, NREM, bnow);
  assert(NREM <= B && ACTING_HELD)
}

inline to_read(me) {
  rh[me] = 0; dirty[me] = 0; pc[me] = P_READ
}

proctype inst(byte me) {
end:
  do
  :: /* a strongly consistent read (GetItem ConsistentRead) */
     d_step { st[me] != GONE && pc[me] == P_READ -> rh[me] = item; dirty[me] = 0; pc[me] = P_DECIDE }
#if FAULT_STALE > 0
  :: /* an eventually consistent read: an older version */
     atomic {
       st[me] != GONE && pc[me] == P_READ && stale_used < FAULT_STALE ->
       select(tv : 0 .. K - 1); rh[me] = OWN(hist[tv], me); tv = 0;
       printf("i%d: stale read\n", me);
       dirty[me] = 1; pc[me] = P_DECIDE;
       if :: FAULT_STALE != 255 -> stale_used++ :: else fi
     }
#endif
  :: /* the remediation ends: restored, back in service (or replaced: asg) */
     d_step { st[me] == REM && pc[me] == P_READ -> printf("i%d: back in service\n", me); st[me] = OK }
  :: atomic {
       st[me] != GONE && pc[me] == P_DECIDE ->
       /* 1. a holder Auto Scaling says is terminated: remove it */
       hg = 255;
       for (hh : 0 .. N - 1) {
         if
#ifndef MUTANT_NO_RELEASE
         :: hh != me && ENT(rh[me], hh) != NO && gone[hh] -> hg = hh
#endif
         :: else
         fi
       }
       if
       :: hg != 255 && lag_used < LAG -> lag_used++; hg = 255   /* the fact not seen yet */
       :: true
       fi;
       if
       :: hg != 255 ->
          cas(me, SETENT(rh[me], hg, NO));
          if :: hok -> printf("i%d: removed i%d, which left the group\n", me, hg) :: else fi
       :: else ->
          if
          :: ENT(rh[me], me) == COM && st[me] == REM -> skip   /* holding while acting */
          :: ENT(rh[me], me) != COM && st[me] == REM ->
             assert(dirty[me])   /* a current read shows an acting instance as committed */
          :: ENT(rh[me], me) == COM && st[me] == WANTS ->
             /* committed before a crash: act now */
             printf("i%d: finds its committed entry\n", me);
             act(me)
          :: ENT(rh[me], me) == COM && st[me] == OK ->
             cas(me, SETENT(rh[me], me, NO));             /* release */
             if :: hok -> printf("i%d: released\n", me) :: else fi
          :: ENT(rh[me], me) == RES && st[me] == WANTS ->
#ifdef MUTANT_BLIND_COMMIT
             item = SETENT(item, me, COM); rh[me] = item; hok = 1;
             for (hh : 0 .. N - 1) {
               if
               :: hh != me && pc[hh] == P_DECIDE -> dirty[hh] = 1; rh[hh] = OWN(rh[hh], hh)
               :: else
               fi
             }
#else
             cas(me, SETENT(rh[me], me, COM));            /* commit */
#endif
             if
             :: hok -> printf("i%d: committed\n", me)
             :: else -> printf("i%d: commit failed (fenced out, or the item changed)\n", me)
             fi
          :: ENT(rh[me], me) == RES && st[me] != WANTS ->
             cas(me, SETENT(rh[me], me, NO))              /* release */
          :: ENT(rh[me], me) == NO && st[me] == WANTS && COUNT(rh[me]) < bnow ->
             cas(me, SETENT(rh[me], me, RES));            /* reserve */
             if
             :: hok -> printf("i%d: reserved\n", me);
                       assert(COUNT(item) <= bnow)  /* a new holder only within today's budget */
             :: else
             fi
          :: ENT(rh[me], me) == NO && st[me] == WANTS && COUNT(rh[me]) >= bnow ->
             /* full: take over a reservation seen unchanged for its lifetime (any, at any
              * moment: there is no clock), or defer */
             if
             :: select(tv : 0 .. N - 1);
                if
#ifdef MUTANT_LEASE
                :: tv != me && ENT(rh[me], tv) != NO ->
#else
                :: tv != me && ENT(rh[me], tv) == RES ->
#endif
                   printf("i%d: takes over i%d's entry (conditional)\n", me, tv);
                   hnew = SETENT(rh[me], tv, NO);
                   cas(me, SETENT(hnew, me, RES));
                   if
                   :: hok -> printf("i%d: took over i%d's entry\n", me, tv)
                   :: else -> printf("i%d: takeover failed\n", me)
                   fi
                :: else
                fi;
                tv = 0
             :: true                                      /* defer */
             fi
          :: else                                         /* nothing to do */
          fi
       fi;
       /* after a successful write the writer knows the item: decide again at once */
       if
       :: hok && ENT(rh[me], me) == COM && st[me] == WANTS -> rh[me] = 0; pc[me] = P_ACT
       :: hok && !(ENT(rh[me], me) == COM && st[me] == WANTS) -> pc[me] = P_DECIDE
       :: else -> to_read(me)
       fi;
       hok = 0; hg = 0; hnew = 0
     }
  :: d_step { st[me] != GONE && pc[me] == P_ACT -> act(me); to_read(me) }
#if FAULT_CRASH > 0
  :: d_step {
       st[me] != GONE && crashes < FAULT_CRASH && pc[me] != P_READ ->
       printf("i%d: crash, restart\n", me); crashes++; to_read(me)
     }
#endif
  od
}

/* Auto Scaling: terminates instances (replacement, scale-in, spot) at any time; and the
 * budget may shrink */
active proctype asg() {
end:
  do
#if FAULT_GONE > 0
  :: atomic {
       ngone < FAULT_GONE ->
       select(tv : 0 .. N - 1);
       if
       :: st[tv] != GONE ->
          printf("asg: i%d terminated\n", tv);
          st[tv] = GONE; gone[tv] = 1; ngone++;
          rh[tv] = 0; dirty[tv] = 0; pc[tv] = P_READ     /* its gpu-medic is gone */
       :: else
       fi;
       tv = 0
     }
#endif
#ifdef FAULT_SHRINK
  :: d_step { bnow == B && B > 1 -> printf("budget shrinks to %d\n", B - 1); bnow = B - 1 }
#endif
  :: false
  od
}

init {
  byte j;
  atomic {
    for (j : 0 .. N - 1) { run inst(j) }
    j = 0
  }
}

#ifdef LIVENESS
ltl gone_released { [] (HBG -> <> !HBG) }
#endif
