/* "HOST:PORT" addresses (HOST may be a name, an IPv4 address, or an IPv6
 * address in brackets: "[::1]:50051"), the form every flag and registry
 * entry of the project uses. */
#ifndef MOE_HOSTPORT_H
#define MOE_HOSTPORT_H

#include <stdbool.h>
#include <stddef.h>

/* Splits `s` at its last ':' into `host` (brackets removed, NUL-terminated;
 * may be empty: "any" for a listener) and `port` (0..65535). False when `s`
 * has no ':' or no port, the port is not a number in range, or the host does
 * not fit `cap` bytes. */
bool moe_hostport_split(const char *s, char *host, size_t cap, int *port);

/* Bytes of the host part as written (brackets kept): everything before the
 * last ':', or the whole string when there is none. For "HOST:OTHERPORT":
 * printf("%.*s:%d", moe_hostport_host_len(s), s, port). */
int moe_hostport_host_len(const char *s);

#endif
