// A sale, its replay, a conflict, a look-up, a cancel and a batch through the Java client
// that openapi-generator (java, library native) makes from openapi.json. Run by
// tests/contract/test_other_languages.py: java SellThrough BASE_URL TOKEN TICKET_PREFIX
import capsvc.gen.ApiClient;
import capsvc.gen.ApiException;
import capsvc.gen.ApiResponse;
import capsvc.gen.api.DrawsApi;
import capsvc.gen.api.TicketsApi;
import capsvc.gen.model.CancelOut;
import capsvc.gen.model.GridIn;
import capsvc.gen.model.TicketIn;
import capsvc.gen.model.TicketOut;
import capsvc.gen.model.TicketDecisionResult;
import capsvc.gen.model.TicketErrorResult;
import capsvc.gen.model.TicketResult;
import capsvc.gen.model.TicketsIn;
import capsvc.gen.model.TicketsOut;
import java.util.List;

public class SellThrough {
  static final List<Integer> TEN = List.of(3, 7, 12, 18, 25, 33, 41, 56, 60, 70);

  static void check(boolean ok, String what) {
    if (!ok) {
      throw new AssertionError(what);
    }
    System.out.println("ok " + what);
  }

  static TicketIn ticket(String id, int draw, long stake) {
    return new TicketIn().ticketId(id).game("fdj-keno").firstDraw(draw)
        .addGridsItem(new GridIn().numbers(TEN).stake(stake))
        .addGridsItem(new GridIn().numbers(List.of(1, 2)).stake(200L));
  }

  public static void main(String[] args) throws Exception {
    String token = args[1];
    String id = args[2] + "-1";
    ApiClient client = new ApiClient();
    client.updateBaseUri(args[0]);
    client.setRequestInterceptor(b -> b.header("Authorization", "Bearer " + token));
    TicketsApi tickets = new TicketsApi(client);
    int draw = new DrawsApi(client).getCurrentDraw("fdj-keno").getDraw();

    ApiResponse<TicketOut> sold = tickets.sellTicketWithHttpInfo(ticket(id, draw, 500));
    check(sold.getData().getStatus() == TicketOut.StatusEnum.ACCEPTED, "sold");
    check(sold.getData().getTotalCost() == 700, "total_cost 700");
    ApiResponse<TicketOut> replay = tickets.sellTicketWithHttpInfo(ticket(id, draw, 500));
    check(List.of("true").equals(replay.getHeaders().get("idempotent-replayed")), "replayed");
    check(replay.getData().getReceipt().getReceiptId()
        .equals(sold.getData().getReceipt().getReceiptId()), "same receipt");
    try {
      tickets.sellTicket(ticket(id, draw, 200));
      check(false, "a conflict is refused");
    } catch (ApiException e) {
      check(e.getCode() == 409 && e.getResponseBody().contains("idempotency_conflict"),
          "409 idempotency_conflict");
    }
    check(tickets.getTicket(id).getState() == null, "not cancelled yet");
    CancelOut cancelled = tickets.cancelTicket(id);
    check(cancelled.getReleased() == 700, "released 700");
    TicketOut after = tickets.getTicket(id);
    check(after.getState() == TicketOut.StateEnum.CANCELLED, "state cancelled");
    check(after.getStatus() == TicketOut.StatusEnum.ACCEPTED, "status still the decision's");
    check(after.getCancelled().getReleased() == 700, "cancelled.released 700");

    TicketsOut batch = tickets.sellTickets(new TicketsIn()
        .addTicketsItem(ticket(args[2] + "-2", draw, 500))
        .addTicketsItem(ticket(args[2] + "-3", draw, 7)));
    List<TicketResult> results = batch.getResults();
    TicketDecisionResult decided = results.get(0).getTicketDecisionResult();
    check(decided.getStatus() == TicketDecisionResult.StatusEnum.NUMBER_200
        && decided.getBody().getTotalCost() == 700, "batch: sold");
    TicketErrorResult refused = results.get(1).getTicketErrorResult();
    check(refused.getStatus() == TicketErrorResult.StatusEnum.NUMBER_422
        && refused.getBody().getError().getCode().equals("stake_not_allowed"),
        "batch: 422 stake_not_allowed in its result");
  }
}
