/*
 * The fleet budget's claim protocol as gpu-medic runs it today (crates/io/src/remedy/budget/claims.rs
 * `acquire_claim`, crates/io/src/remedy/aws/drain.rs `begin`, crates/io/src/remedy/budget/group_view.rs `admit`,
 * `rank`, `holds_slot`),
 * and with -DREPAIRED the repair of issue 17 item 3. N gpu-medics of one Auto Scaling
 * group, budget B, every one of them wanting to drain its instance.
 *
 * Checked: never more than B instances of the group in remediation (DRAINING, Unhealthy,
 * Terminating, or their capacity missing until the successor is in service). An assertion
 * at the moment a drain takes effect.
 *
 * Time is discrete. One tick is the unit of claim_settle (S ticks) and claim_ttl (TTL
 * ticks). Steps within a tick interleave freely. Every time is kept relative to now (ages
 * that saturate, countdowns), so the state space is finite without a horizon: the check
 * covers runs of any length. wake[i] is the number of ticks before instance i must have
 * taken its next step: the clock does not tick while some wake[i] is 0. That is how "no
 * pause here" is said; NOWAKE means the step may wait for ever.
 *
 * Faults (compile-time switches; models/README.md gives the counterexample of each):
 *   -DFAULT_DELAY       a claim becomes visible to readers up to S+1 ticks after its write
 *                       returned, later than the settle (the baseline: within S)
 *   -DFAULT_SKEW        wall clocks differ: each instance's is 0 or SKEW ticks ahead (TTL)
 *   -DFAULT_PAUSE       a pause of any length between the re-read/rank and the last step
 *                       before the drain call (where REPAIRED checks the claim's age again)
 *   -DFAULT_PAUSE_LATE  a pause of any length (-DPLATE=k: up to k ticks) after that last
 *                       step, before the drain takes effect (a slow or stalled
 *                       UpdateContainerInstancesState)
 *   -DFAULT_SLOW_WRITE  a claim write that takes up to S ticks to return (its time is taken
 *                       before the call); readers see it within S of the return
 *   -DFAULT_SLOW_PAUSE  a claim write that takes up to S ticks to return, readers seeing it
 *                       by then, and a pause of up to TTL-2S ticks after the rank; each
 *                       alone is tolerated (-DPMAX_SLOW=0, -DWMAX_SLOW=0 pass)
 *   -DFAULT_MISSING     any read of the group may miss one member (paging, registration)
 *   -DFAULT_CRASH       one crash of one gpu-medic at any point, restarted at once or later
 *   -DFAULT_GAP         Auto Scaling terminates a replaced instance before its successor
 *                       shows as Pending (no instance maintenance policy)
 *   -DFAULT_NOASG       instance N-1 has no Auto Scaling group in its identity: its view is
 *                       the cluster (ECS only) and its budget that of the cluster (B + 1;
 *                       -DNOASG_BUDGET=B for a count)
 *
 * Baseline (no switch): claims and DRAINING visible to every reader within S ticks of the
 * write; no pause between the re-read and the drain; pauses of any length anywhere else
 * (before the first read, between admit and claim, before a retry); equal clocks; complete
 * views; launch-before-terminate replacement.
 */

#ifndef N
#define N 3
#endif
#ifndef B
#define B 1
#endif
#ifndef S
#define S 2
#endif
#ifndef TTL
#define TTL 10
#endif
/* FAULT_SLOW_WRITE, FAULT_SLOW_PAUSE: how long a claim write may take; FAULT_SLOW_PAUSE:
 * how long the pause after the rank may be (the longest tolerated alone: S + P + S <= TTL) */
#ifndef WMAX_SLOW
#define WMAX_SLOW S
#endif
#ifndef PMAX_SLOW
#define PMAX_SLOW (TTL - 2 * S)
#endif

#define NONE 255
#define NOWAKE 255

/* st[i]: the instance, ground truth */
#define ACTIVE 0   /* in service */
#define REM    1   /* DRAINING, then Unhealthy, Terminating: every view counts it */
#define GONE   2   /* terminated, successor not launched yet: absent from every view */
#define PEND   3   /* successor Pending / warming up: Auto Scaling views count it */
#define DONE   4   /* successor in service: this remediation is over */

/* the program counter of instance i's gpu-medic */
#define P_START  0 /* first read of the group: resume an own claim, or admit */
#define P_CLAIM  1 /* write the claim */
#define P_SETTLE 2 /* sleep claim_settle, re-read, rank */
#define P_ACT    3 /* ranked within the budget; the last step before the drain call */
#define P_LAND   4 /* the drain call, taking effect */
#define P_DONE   5

#ifdef FAULT_DELAY
#define DV (S + 1)
#else
#define DV S
#endif
#ifdef FAULT_SKEW
#ifndef SKEW
#define SKEW TTL
#endif
#define SKMAX SKEW
#else
#define SKMAX 0
#endif
/* the claim write: returns after up to WMAX ticks; readers see the claim at most VMAX
 * ticks after it returned */
#if defined(FAULT_SLOW_WRITE) || defined(FAULT_SLOW_PAUSE)
#define WMAX WMAX_SLOW
#else
#define WMAX 0
#endif
#ifdef FAULT_SLOW_PAUSE
#define VMAX 0
#else
#define VMAX DV
#endif
/* how long a gpu-medic may take after the rank, before its last step (ticks) */
#ifdef FAULT_PAUSE
#define ACT_WAKE NOWAKE
#elif defined(FAULT_SLOW_PAUSE)
#define ACT_WAKE PMAX_SLOW
#else
#define ACT_WAKE 0
#endif
#ifdef FAULT_PAUSE_LATE
#ifndef PLATE
#define PLATE NOWAKE
#endif
#define LAND_WAKE PLATE
#else
#define LAND_WAKE 0
#endif
#ifdef FAULT_NOASG
#define NOASG_R(r) ((r) == N - 1)
#else
#define NOASG_R(r) false
#endif
#ifdef FAULT_GAP
#define AFTER_REM GONE
#else
#define AFTER_REM PEND
#endif

/* the no-group instance's budget: max_parallel of the whole cluster (a share of a cluster
 * larger than the group); -DNOASG_BUDGET=B: a count */
#ifndef NOASG_BUDGET
#define NOASG_BUDGET (B + 1)
#endif
#define BUDGET(r) (NOASG_R(r) -> NOASG_BUDGET : B)
/* a claim age at which it is expired for every reader, whatever the skews */
#define CAP (TTL + SKMAX + 1)

byte skew[N];     /* instance i's wall clock runs skew[i] ticks ahead of true time */
byte age[N];      /* the claim attribute on i: true ticks since its time was taken; NONE */
byte cvis[N];     /* ticks until readers see the claim (0: visible) */
byte st[N];
byte dvis[N];       /* ticks until readers see st[i] == REM as DRAINING (0: visible) */
byte wake[N];     /* ticks until instance i must take its next step; NOWAKE: none */
byte crashes;
byte miss = NONE; /* the member one read misses (FAULT_MISSING) */
byte tv;          /* scratch for select, 0 between steps */

hidden byte hi, hcnt, hmem, hok, hold;

/* claim j as r reads it: r's wall clock minus the claim's time, in ticks */
#define RAGE(r, j) (age[j] + skew[r] - skew[j])
#define LIVE(r, j) (age[j] != NONE && cvis[j] == 0 && RAGE(r, j) < TTL)
/* (claim time, instance id) of j before that of r; claim time = skew - age */
#define AHEAD(j, r) (skew[j] + age[r] < skew[r] + age[j] || \
                     (skew[j] + age[r] == skew[r] + age[j] && (j) < (r)))
#define IN_VIEW(r, j) ((j) != miss && st[j] != GONE && !(NOASG_R(r) && st[j] == PEND))
#define BUSY_V(j) ((st[j] == REM && dvis[j] == 0) || st[j] == PEND)
/* less than two settles of TTL left, by the owner's own clock */
#define TOO_OLD(r) (age[r] + 2 * S > TTL)

#if N == 3
#define CAN_TICK (wake[0] > 0 && wake[1] > 0 && wake[2] > 0)
#define NREM ((st[0] == REM || st[0] == GONE || st[0] == PEND) + \
              (st[1] == REM || st[1] == GONE || st[1] == PEND) + \
              (st[2] == REM || st[2] == GONE || st[2] == PEND))
#elif N == 4
#define CAN_TICK (wake[0] > 0 && wake[1] > 0 && wake[2] > 0 && wake[3] > 0)
#define NREM ((st[0] == REM || st[0] == GONE || st[0] == PEND) + \
              (st[1] == REM || st[1] == GONE || st[1] == PEND) + \
              (st[2] == REM || st[2] == GONE || st[2] == PEND) + \
              (st[3] == REM || st[3] == GONE || st[3] == PEND))
#else
#error "N must be 3 or 4"
#endif

/* fleet.rs over r's view now. ranking == 0: admit (every other member in remediation or
 * with a live claim counts); ranking == 1: rank (members in remediation, and live claims
 * ahead of r's own). hok: fewer than the budget. REPAIRED also counts desired - members
 * (desired is N: Auto Scaling keeps it while replacing). */
inline count_view(r, ranking) {
  hcnt = 0; hmem = 0;
  for (hi : 0 .. N - 1) {
    if
    :: IN_VIEW(r, hi) ->
       hmem++;
       if
       :: hi != r && (BUSY_V(hi) || (LIVE(r, hi) && (ranking == 0 || AHEAD(hi, r)))) ->
          hcnt++
       :: else
       fi
    :: else
    fi
  }
#ifdef REPAIRED
  if
  :: !NOASG_R(r) -> hcnt = hcnt + (N - hmem)
  :: else
  fi
#endif
  hok = (hcnt < BUDGET(r))
}

inline choose_miss(r) {
#ifdef FAULT_MISSING
  if
  :: miss = NONE
  :: select(tv : 0 .. N - 1); miss = (tv == r -> NONE : tv); tv = 0;
     if :: miss != NONE -> printf("i%d: this read misses i%d\n", r, miss) :: else fi
  fi
#else
  skip
#endif
}

inline withdraw(r) {
  age[r] = NONE; cvis[r] = 0; wake[r] = NOWAKE; pc = P_START
}

proctype inst(byte me) {
  byte pc = P_START;
end:
  do
  :: /* acquire_claim: read the group; an own live claim (from before a restart) is
      * resumed, otherwise an expired own claim is deleted, then admit */
     atomic {
       pc == P_START ->
       choose_miss(me);
       d_step {
         hold = LIVE(me, me);
#ifdef REPAIRED
         if
         :: hold && TOO_OLD(me) -> hold = 0   /* too old to finish: withdraw, claim anew */
         :: else
         fi
#endif
         if
         :: hold ->
#ifdef REPAIRED
            /* a resumed claim settles again before ranking */
            printf("i%d: restarted, own claim settles again\n", me);
            wake[me] = S; pc = P_SETTLE
#else
            /* today: ranked at once on this view */
            count_view(me, 1);
            if
            :: hok -> printf("i%d: restarted, own claim ranked at once: within budget\n", me);
                      wake[me] = ACT_WAKE; pc = P_ACT
            :: else -> printf("i%d: restarted, own claim outranked: withdrawn\n", me);
                       withdraw(me)                  /* outranked: delete, defer */
            fi
#endif
         :: else ->
            if
            :: age[me] != NONE && cvis[me] == 0 -> age[me] = NONE   /* delete it */
            :: else
            fi;
            count_view(me, 0);
            if
            :: hok -> printf("i%d: admitted (%d busy in view)\n", me, hcnt);
                      pc = P_CLAIM       /* a pause before the claim is harmless */
            :: else -> printf("i%d: deferred (%d busy in view)\n", me, hcnt)
            fi
         fi;
         miss = NONE
       }
     }
  :: /* claim_ms = now_ms(); PutAttributes returns after w <= WMAX ticks; readers see the
      * claim within w + VMAX ticks; then sleep claim_settle */
     atomic {
       pc == P_CLAIM ->
       select(tv : 0 .. WMAX); wake[me] = tv + S;
       select(tv : 0 .. wake[me] - S + VMAX); cvis[me] = tv; tv = 0;
       age[me] = 0;
       printf("i%d: claim written: returns in %d, visible in %d, re-read in %d ticks\n",
              me, wake[me] - S, cvis[me], wake[me]);
       pc = P_SETTLE
     }
  :: atomic {
       pc == P_SETTLE && wake[me] == 0 ->
       choose_miss(me);
       d_step {
         count_view(me, 1);
#ifdef REPAIRED
         hok = hok && !TOO_OLD(me);
#endif
         if
         :: hok -> printf("i%d: re-read, ranked within budget (%d ahead, claim age %d)\n",
                          me, hcnt, age[me]);
                   wake[me] = ACT_WAKE; pc = P_ACT
         :: else -> printf("i%d: re-read, outranked or too old: withdrawn\n", me);
                    withdraw(me)      /* outranked (or too old): delete, retry later */
         fi;
         miss = NONE
       }
     }
  :: d_step {
       pc == P_ACT ->
#ifdef REPAIRED
       /* checked again just before acting */
       if
       :: TOO_OLD(me) -> printf("i%d: claim too old to act: withdrawn\n", me); withdraw(me)
       :: else -> wake[me] = LAND_WAKE; pc = P_LAND
       fi
#else
       wake[me] = LAND_WAKE; pc = P_LAND
#endif
     }
  :: /* DRAINING takes effect; readers see it within S ticks */
     atomic {
       pc == P_LAND ->
       st[me] = REM;
       printf("i%d: DRAINING (claim age %d); in remediation now: %d\n", me, age[me], NREM);
       select(tv : 0 .. S); dvis[me] = tv; tv = 0;
       assert(NREM <= B);
       wake[me] = NOWAKE; pc = P_DONE
     }
#ifdef FAULT_CRASH
  :: d_step { crashes < 1 && pc != P_START && pc != P_DONE -> printf("i%d: crash (restarts later)\n", me); crashes++; wake[me] = NOWAKE; pc = P_START }
#endif
  od
}

/* Auto Scaling replaces a drained instance after any time: the old instance leaves with
 * its claim, the successor is Pending, then in service (and never faulted in this model) */
proctype asg(byte j) {
end:
  do
  :: d_step { st[j] == REM -> printf("asg: i%d terminated (successor Pending: %d)\n", j, AFTER_REM == PEND);
                               age[j] = NONE; cvis[j] = 0; dvis[j] = 0; st[j] = AFTER_REM }
  :: d_step { st[j] == GONE -> printf("asg: successor of i%d Pending\n", j); st[j] = PEND }
  :: d_step { st[j] == PEND -> printf("asg: successor of i%d in service\n", j); st[j] = DONE }
  od
}

inline tick_one(j) {
  if :: age[j] != NONE && age[j] < CAP -> age[j]++ :: else fi;
  if :: cvis[j] > 0 -> cvis[j]-- :: else fi;
  if :: dvis[j] > 0 -> dvis[j]-- :: else fi;
  if :: wake[j] != NOWAKE -> wake[j]-- :: else fi
}

active proctype clock() {
end:
  do
  :: d_step {
       CAN_TICK ->
       printf("-- tick --\n");
       tick_one(0); tick_one(1); tick_one(2);
#if N == 4
       tick_one(3);
#endif
       skip
     }
  od
}

init {
  byte j;
  atomic {
    for (j : 0 .. N - 1) {
      age[j] = NONE; wake[j] = NOWAKE;
      if
      :: skew[j] = SKMAX
      :: skew[j] = 0
      fi;
      if :: skew[j] > 0 -> printf("i%d: wall clock %d ticks ahead\n", j, skew[j]) :: else fi
    }
#ifdef FAULT_NOASG
    printf("i%d: no Auto Scaling group: the cluster is its group, budget %d\n", N - 1, NOASG_BUDGET);
#endif
    for (j : 0 .. N - 1) {
      run inst(j); run asg(j)
    }
    j = 0
  }
}
