/*
 * The circuit breaker beside the fleet budget (issue "3/5", item 1a; models/README.md,
 * "The breaker never deadlocks the repairs the budget allows").
 *
 * A group of N instances; F of them (ids 0 .. F-1) develop a fault, each at any moment, at
 * most once; a faulted instance is quarantined and asks the fleet gate for a slot. The gate
 * reads the group (one atomic look: each instance's state as ECS and Auto Scaling show it)
 * and decides:
 *   - the breaker: more unhealthy instances (faulted and waiting, or in remediation; the asker
 *     included) than LIMIT holds new remediation;
 *   - the budget: at most B in remediation (the slot protocol's own guarantee, checked in
 *     slots.pml, is taken as given here: the reservation is one atomic step).
 * An instance let through is in remediation (drained, rebooted or replaced) and comes back in
 * service some time later; it never faults again here.
 *
 * TODAY (-DTODAY): the breaker as it stood, which counts every unhealthy instance and holds
 * while there are more than LIMIT. Two faults at once in a group of 8 (LIMIT 1, 20 % of 8)
 * hold each other for ever: liveness fails.
 * The rule (default): while the breaker is open, the repair it always lets through is one at a
 * time: when nothing is in remediation, the waiting instance with the lowest id goes ahead.
 *
 * Checked: safety (an assertion at every admission: at most B in remediation), and with
 * -DLIVENESS the LTL property `all_repaired`: every faulted instance is eventually back in
 * service (pan -a -f: weak fairness, so no instance is starved by the scheduler alone).
 */

#ifndef N
#define N 8
#endif
#ifndef F
#define F 2
#endif
#ifndef LIMIT
#define LIMIT 1
#endif
#ifndef B
#define B 1
#endif

#define HEALTHY 0
#define WAITING 1   /* faulted, quarantined, asking for a slot */
#define REM     2   /* in remediation */
#define BACK    3   /* repaired (or its successor in service) */

byte st[F];         /* instances F .. N-1 stay healthy: they count only in the group's size */
byte in_rem = 0;
byte repaired = 0;

/* unhealthy as the breaker counts them */
inline unhealthy(n) {
    n = 0;
    j = 0;
    do
    :: j < F -> if :: st[j] == WAITING || st[j] == REM -> n++ :: else -> skip fi; j++
    :: else -> break
    od
}

/* the lowest id waiting */
inline first_waiting(w) {
    w = 255;
    j = 0;
    do
    :: j < F && w == 255 -> if :: st[j] == WAITING -> w = j :: else -> skip fi; j++
    :: j < F && w != 255 -> break
    :: j >= F -> break
    od
}

proctype instance(byte me) {
    byte n, w, j;
    /* healthy until the fault, at any moment */
    st[me] = WAITING;
ask:
    atomic {
        unhealthy(n);
        first_waiting(w);
        if
#ifdef TODAY
        :: n > LIMIT -> skip                     /* held: the breaker is open */
#else
        :: n > LIMIT && !(in_rem == 0 && w == me) -> skip   /* held, but one goes */
#endif
        :: else ->
            if
            :: in_rem < B ->
                in_rem++;
                assert(in_rem <= B);
                st[me] = REM
            :: else -> skip                      /* the budget is full */
            fi
        fi;
        n = 0; w = 0; j = 0                      /* no leftovers: fewer states */
    }
    if
    :: st[me] == WAITING -> goto ask             /* asks again after its retry */
    :: else -> skip
    fi;
    /* the drain, reboot or replacement, then back in service */
    atomic { st[me] = BACK; in_rem--; repaired++ }
}

init {
    byte i = 0;
    atomic {
        do
        :: i < F -> run instance(i); i++
        :: else -> break
        od
    }
}

#ifdef LIVENESS
ltl all_repaired { <> (repaired == F) }
#endif
