// The same through openapi-typescript's types (default options) and openapi-fetch, compiled
// by tsc --strict. Run by tests/contract/test_other_languages.py:
//   node out/sell_typed.js BASE_URL TOKEN TICKET_PREFIX
import createClient from "openapi-fetch";
import type { components, paths } from "./src/capsvc-schema";

type TicketIn = components["schemas"]["TicketIn"];
const [base, token, prefix] = process.argv.slice(2);
const TEN = [3, 7, 12, 18, 25, 33, 41, 56, 60, 70];

function check(ok: boolean, what: string): void {
  if (!ok) throw new Error(`failed: ${what}`);
  console.log(`ok ${what}`);
}

function ticket(ticket_id: string, draw: number, stake: number): TicketIn {
  // Only what a sale needs: the fields with defaults (draws, multiplier, joker_plus,
  // player_id) are optional in the generated types.
  return { ticket_id, game: "fdj-keno", first_draw: draw,
           grids: [{ numbers: TEN, stake }, { numbers: [1, 2], stake: 200 }] };
}

async function main(): Promise<void> {
  const api = createClient<paths>({ baseUrl: base,
                                    headers: { Authorization: `Bearer ${token}` } });
  const current = await api.GET("/v1/games/{game}/draws/current",
                                { params: { path: { game: "fdj-keno" } } });
  const draw = current.data!.draw;
  const id = `${prefix}-1`;

  const sold = await api.POST("/v1/tickets", { body: ticket(id, draw, 500) });
  check(sold.data?.status === "accepted" && sold.data.total_cost === 700,
        "sold, total_cost 700");
  const replay = await api.POST("/v1/tickets", { body: ticket(id, draw, 500) });
  check(replay.response.headers.get("Idempotent-Replayed") === "true", "replayed");
  check(replay.data?.receipt?.receipt_id === sold.data?.receipt?.receipt_id,
        "same receipt");
  const conflict = await api.POST("/v1/tickets", { body: ticket(id, draw, 200) });
  check(conflict.response.status === 409
        && conflict.error?.error.code === "idempotency_conflict", "409 idempotency_conflict");
  const path = { params: { path: { ticket_id: id } } };
  check((await api.GET("/v1/tickets/{ticket_id}", path)).data?.state === undefined,
        "not cancelled yet");
  const cancelled = await api.POST("/v1/tickets/{ticket_id}/cancel", path);
  check(cancelled.data?.released === 700, "released 700");
  const after = (await api.GET("/v1/tickets/{ticket_id}", path)).data;
  check(after?.state === "cancelled" && after.status === "accepted", "state cancelled");
  check(after?.cancelled?.released === 700, "cancelled.released 700");

  const batch = await api.POST("/v1/ticket-batches", { body: { tickets: [
    ticket(`${prefix}-2`, draw, 500), ticket(`${prefix}-3`, draw, 7)] } });
  const [ok, refused] = batch.data!.results;
  check(ok.status === 200 && "total_cost" in ok.body && ok.body.total_cost === 700,
        "batch: sold");
  check(refused.status === 422 && "error" in refused.body
        && refused.body.error.code === "stake_not_allowed",
        "batch: 422 stake_not_allowed in its result");
}

main().catch((e: unknown) => { console.error(e); process.exit(1); });
