// A sale, its replay, a conflict, a look-up, a cancel and a batch through the TypeScript
// client that openapi-generator (typescript-fetch) makes from openapi.json, compiled by
// tsc --strict. Run by tests/contract/test_other_languages.py:
//   node out/sell_fetch.js BASE_URL TOKEN TICKET_PREFIX
import {
  Configuration, DrawsApi, ResponseError, TicketsApi, type TicketIn, type TicketOut,
} from "./src/capsvc";

const [base, token, prefix] = process.argv.slice(2);
const TEN = [3, 7, 12, 18, 25, 33, 41, 56, 60, 70];

function check(ok: boolean, what: string): void {
  if (!ok) throw new Error(`failed: ${what}`);
  console.log(`ok ${what}`);
}

function ticket(ticketId: string, draw: number, stake: number): TicketIn {
  return { ticketId, game: "fdj-keno", firstDraw: draw,
           grids: [{ numbers: TEN, stake }, { numbers: [1, 2], stake: 200 }] };
}

async function main(): Promise<void> {
  const config = new Configuration({ basePath: base, accessToken: token });
  const tickets = new TicketsApi(config);
  const draw = (await new DrawsApi(config).getCurrentDraw({ game: "fdj-keno" })).draw;
  const id = `${prefix}-1`;

  const sold = await tickets.sellTicketRaw({ ticketIn: ticket(id, draw, 500) });
  const first: TicketOut = await sold.value();
  check(first.status === "accepted" && first.totalCost === 700, "sold, total_cost 700");
  const replay = await tickets.sellTicketRaw({ ticketIn: ticket(id, draw, 500) });
  check(replay.raw.headers.get("Idempotent-Replayed") === "true", "replayed");
  check((await replay.value()).receipt?.receiptId === first.receipt?.receiptId,
        "same receipt");
  try {
    await tickets.sellTicket({ ticketIn: ticket(id, draw, 200) });
    check(false, "a conflict is refused");
  } catch (e) {
    const body = e instanceof ResponseError ? await e.response.json() : null;
    check(e instanceof ResponseError && e.response.status === 409
          && body.error.code === "idempotency_conflict", "409 idempotency_conflict");
  }
  check((await tickets.getTicket({ ticketId: id })).state === undefined, "not cancelled yet");
  check((await tickets.cancelTicket({ ticketId: id })).released === 700, "released 700");
  const after = await tickets.getTicket({ ticketId: id });
  check(after.state === "cancelled" && after.status === "accepted", "state cancelled");
  check(after.cancelled?.released === 700, "cancelled.released 700");

  const batch = await tickets.sellTickets({ ticketsIn: { tickets: [
    ticket(`${prefix}-2`, draw, 500), ticket(`${prefix}-3`, draw, 7)] } });
  const [ok, refused] = batch.results;
  check(ok.status === 200 && "totalCost" in ok.body && ok.body.totalCost === 700,
        "batch: sold");
  check(refused.status === 422 && "error" in refused.body
        && refused.body.error.code === "stake_not_allowed",
        "batch: 422 stake_not_allowed in its result");
}

main().catch((e: unknown) => { console.error(e); process.exit(1); });
